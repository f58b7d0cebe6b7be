"""What the structured-output tests share: a tiny byte-level BPE tokenizer, the bytes each
of its tokens spells as llguidance reads them, and outlines-core's own answer (an `Index`
of the regex followed by the END marker, read in eqrope's convention) to compare with.

eqrope compiles `(?:REGEX)` followed by U+10FFFF, which a pseudo-token (id: the
vocabulary's size) spells (`eqrope/structured/_compile.py`); a state accepts where END
leads to a final state, and only tokens that can still reach an accepting state are kept.
`Outlines` computes that from outlines-core's `Index` alone, never from eqrope's export.
"""

import numpy as np

from _serve import TEXTS, byte_level_bpe


EOS = 1  # "</s>"


def bpe_tokenizer():
    """A `tokenizers.Tokenizer`: byte-level BPE of at most 400 tokens (`byte_level_bpe`)
    learnt from `TEXTS` and a JSON record."""
    return byte_level_bpe(400, TEXTS * 4 + ['{"name": "x", "ok": true, "tags": ["a", "b"]}'] * 4)


def spelled_by_llguidance(raw, lltok) -> list[bytes]:
    """Each token's bytes as llguidance's `decode_bytes` reads them (`b""` for specials)."""
    special = set(raw.get_added_tokens_decoder())
    return [b"" if i in special else lltok.decode_bytes([i]) for i in range(raw.get_vocab_size())]


def outlines_index(oc, regex: str, spelled: list[bytes]):
    """outlines-core's `Index` of `regex` followed by END, over `spelled` (END's id:
    `len(spelled)`; EOS: `EOS`)."""
    ids: dict[bytes, list[int]] = {"\U0010ffff".encode(): [len(spelled)]}
    for i, b in enumerate(spelled):
        if b:
            ids.setdefault(b, []).append(i)
    return oc.Index(f"(?:{regex})\\x{{10ffff}}", oc.Vocabulary(EOS, ids))


class Outlines:
    """outlines-core's `Index` read in eqrope's convention: `allowed(state)` is the set of
    ids (EOS among them where the state accepts) that an eqrope automaton's state must
    allow, and `next(state, token)` outlines-core's next state."""

    def __init__(self, oc, regex: str, spelled: list[bytes]):
        self.index = index = outlines_index(oc, regex, spelled)
        self.end, self.vocab = len(spelled), len(spelled)
        table, finals = index.get_transitions(), index.get_final_states()
        productive = {s for s, row in table.items() if row.get(self.end) in finals}
        while True:  # the states from which an END can be reached
            more = {
                s for s, row in table.items()
                if s not in productive and any(d in productive for t, d in row.items() if t not in (EOS, self.end))
            }  # fmt: skip
            if not more:
                break
            productive |= more
        self.productive, self.finals = productive, finals
        self._masks: dict[int, np.ndarray] = {}

    @property
    def initial(self) -> int:
        return self.index.get_initial_state()

    def accepting(self, state: int) -> bool:
        return self.index.get_next_state(state, self.end) in self.finals if self.end in self.index.get_allowed_tokens(state) else False

    def allowed(self, state: int) -> set[int]:
        """The tokens that lead on to an accepting state, and EOS where `state` accepts."""
        tokens = set(self.index.get_allowed_tokens(state)) - {EOS, self.end}
        out = {t for t in tokens if self.index.get_next_state(state, t) in self.productive}
        return out | ({EOS} if self.accepting(state) else set())

    def mask(self, state: int, vocab: int) -> np.ndarray:
        """`allowed(state)` as a boolean vector over `vocab` ids (cached by state)."""
        if state not in self._masks:
            m = np.zeros(vocab, bool)
            m[sorted(self.allowed(state))] = True
            self._masks[state] = m
        return self._masks[state]

    def next(self, state: int, token: int) -> int:
        return self.index.get_next_state(state, token)
