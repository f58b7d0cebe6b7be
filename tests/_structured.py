"""What the structured-output tests share: a tiny byte-level BPE tokenizer, the bytes each
of its tokens spells as llguidance reads them, and outlines-core's own answer (an `Index`
of the regex followed by the END marker, read in eqrope's convention) to compare with.

eqrope compiles `(?:REGEX)` followed by U+10FFFF, which a pseudo-token (id: the
vocabulary's size) spells (`eqrope/structured/_compile.py`); a state accepts where END
leads to a final state, and only tokens that can still reach an accepting state are kept.
`Outlines` computes that from outlines-core's `Index` alone, never from eqrope's export.
`allowed`, `step`, `distances` and `walk` read an `Automaton` in NumPy.
"""

import random

import numpy as np
import pytest

import eqrope
from _serve import TEXTS, byte_level_bpe


EOS = 1  # "</s>"


def bpe_tokenizer():
    """A `tokenizers.Tokenizer`: byte-level BPE of at most 400 tokens (`byte_level_bpe`)
    learnt from `TEXTS` and a JSON record."""
    return byte_level_bpe(400, TEXTS * 4 + ['{"name": "x", "ok": true, "tags": ["a", "b"]}'] * 4)


@pytest.fixture(scope="module")
def raw():
    """`bpe_tokenizer()`, once per test module that imports this fixture."""
    return bpe_tokenizer()


@pytest.fixture(scope="module")
def tok(raw):
    return eqrope.Tokenizer(raw, eos_ids=[EOS])


@pytest.fixture(scope="module")
def lltok(raw):
    import llguidance

    return llguidance.LLTokenizer(raw.to_str(), eos_token=EOS)


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


# --- reading an Automaton (the layout of generation/_automaton.py) -------------------------


def allowed(a, s: int) -> set[int]:
    bits = np.unpackbits(np.ascontiguousarray(a.allowed[s]).view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


def step(a, s: int, t: int) -> int:
    lo, hi = int(a.exc_start[s]), int(a.exc_start[s + 1])
    at = lo + int(np.searchsorted(a.exc_token[lo:hi], t))
    return int(a.exc_next[at]) if at < hi and a.exc_token[at] == t else int(a.default_next[s])


def distances(a) -> np.ndarray:
    """Tokens from each state to an accepting one (a reverse breadth-first search)."""
    n = a.accepting.size
    into = [[] for _ in range(n)]
    for s in range(n):
        for t in allowed(a, s):
            into[step(a, s, t)].append(s)
    dist = np.full(n, np.iinfo(np.int64).max)
    frontier = list(np.flatnonzero(a.accepting))
    dist[frontier] = 0
    while frontier:
        nxt = []
        for d in frontier:
            for s in into[d]:
                if dist[s] > dist[d] + 1:
                    dist[s] = dist[d] + 1
                    nxt.append(s)
        frontier = nxt
    return dist


def walk(a, rng: random.Random, dist=None, limit: int = 400) -> list[int] | None:
    """A random path from the start to an accepting state (`None` past `limit` tokens);
    every other step (when `dist` is given) moves closer to acceptance."""
    s, path = 0, []
    while len(path) < limit:
        options = sorted(allowed(a, s))
        if a.accepting[s] and (not options or rng.random() < 0.25):
            return path
        assert options, f"state {s} neither accepts nor allows a token"
        if dist is not None and rng.random() < 0.5:
            best = min(dist[step(a, s, t)] for t in options)
            options = [t for t in options if dist[step(a, s, t)] == best]
        t = rng.choice(options)
        path.append(t)
        s = step(a, s, t)
    return None


# A nested record: an object in an object, an array of a `$ref`d enum, optional properties.
NESTED = {
    "$defs": {"color": {"enum": ["red", "green", "blue"]}},
    "type": "object",
    "properties": {
        "user": {
            "type": "object",
            "properties": {"id": {"type": "integer"}, "tags": {"type": "array", "items": {"$ref": "#/$defs/color"}, "maxItems": 3}},
            "required": ["id"],
            "additionalProperties": False,
        },
        "status": {"enum": ["open", "closed", None]},
        "note": {"type": "string", "maxLength": 3},
    },
    "required": ["user", "status"],
    "additionalProperties": False,
}
