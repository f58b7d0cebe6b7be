"""Stop strings matched on the text (issue 43, S1), against three independent references:

- transformers' `generate(stop_strings=...)` on the same checkpoint (a byte-level BPE and
  a random Llama written with `eqrope.to_hf`), for 20 strings that the model writes with
  other tokens than the string's own encoding;
- a byte-level search: a text ends in a stop string when the string occurs in its bytes
  and reaches into the last token (random vocabularies, every prefix of random texts);
- the tokenizer's own `decode`, for the bytes each token spells.
"""

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqrope
from eqrope.generation._stop_strings import NO_TEXT_STOPS, ends_with_text, host_ends_with_text, text_stops
from eqrope.testing import Uncached

from _compiles import counting
from _models import random_model
from _serve import TEXTS, write_checkpoint


PROMPT = "The cat sat"
NEW = 100


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("stop") / "ckpt")


@pytest.fixture(scope="module")
def tok(checkpoint):
    return eqrope.Tokenizer.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def model(checkpoint):
    return eqrope.from_hf(checkpoint)


def _free(model, tok, prompt: str):
    """The prompt's ids and the greedy new tokens without any stop."""
    ids = np.asarray(tok.encode(prompt), np.int32)
    out = eqrope.generate(model, ids, NEW, eos_id=list(tok.eos_ids), return_logprobs=True)
    return ids, np.asarray(out.tokens)[len(ids) : int(out.lengths)].tolist()


@pytest.fixture(scope="module")
def free(model, tok):
    return _free(model, tok, PROMPT)


def _crossing_strings(tok, new: list[int], count: int, prompt: str = PROMPT) -> list[str]:
    """`count` strings of the new text (valid UTF-8, 1 to 5 bytes, first found there, not
    in the prompt) that the model writes with other tokens than the string's own
    encoding, each ending at a different place."""
    spelled = tok.token_bytes()
    pieces = [spelled[t] for t in new]
    text = b"".join(pieces)
    before = b"".join(spelled[t] for t in tok.encode(prompt))
    bounds = np.cumsum([0] + [len(p) for p in pieces])
    found, ends = [], set()
    for size in (3, 2, 4, 5, 1):
        for start in range(len(text) - size + 1):
            end = start + size
            try:
                s = text[start:end].decode()
            except UnicodeDecodeError:
                continue
            first = (before + text).find(text[start:end]) == len(before) + start
            if end in ends or not first or not s.isprintable():
                continue
            first = int(np.searchsorted(bounds, start, side="right")) - 1
            last = int(np.searchsorted(bounds, end, side="left"))
            if tok.encode(s, add_special_tokens=False) != new[first:last]:
                found.append(s)
                ends.add(end)
            if len(found) == count:
                return found
    return found


def test_twenty_strings_stop_where_transformers_stops(checkpoint, tok, model):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32)
    hf_tok = transformers.AutoTokenizer.from_pretrained(checkpoint)
    cases = []
    for text in ("One, two", PROMPT):  # two prompts, for text of some variety
        ids, new = _free(model, tok, text)
        cases += [(text, ids, new, s) for s in _crossing_strings(tok, new, 20 - len(cases), text)]
    assert len(cases) == 20

    def theirs(ids, **kwargs):
        prompt = torch.tensor(ids[None].astype(np.int64))
        out = hf_model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW, do_sample=False,
            eos_token_id=list(tok.eos_ids), pad_token_id=tok.pad_id, **kwargs,
        )  # fmt: skip
        return out[0, len(ids) :].tolist()

    for text, ids, new, s in cases:
        if s == cases[0][3] or s == cases[-1][3]:
            assert theirs(ids) == new  # the same greedy text before any stop
        stop = eqrope.StopStrings(tok, [s])
        out = eqrope.generate(model, ids, NEW, eos_id=list(tok.eos_ids), stop=[stop], return_logprobs=True)
        ours = np.asarray(out.tokens)[len(ids) : int(out.lengths)].tolist()
        assert ours == theirs(ids, stop_strings=[s], tokenizer=hf_tok), s
        assert len(ours) < len(new), s  # it stopped early...
        assert s in tok.decode(ours), s  # ...on the string
        # generate_text stops at the same token, and keeps it whole.
        assert eqrope.generate_text(model, tok, text, NEW, stop=[s]) == tok.decode(ours, skip_special_tokens=True)


def test_strings_and_token_sequences_together(tok, model, free):
    ids, new = free
    a, b = _crossing_strings(tok, new, 2)
    late = new[60:62]
    both = eqrope.generate_text(model, tok, PROMPT, NEW, stop=[late, b, a])
    alone = [eqrope.generate_text(model, tok, PROMPT, NEW, stop=s) for s in ([late], [a], b)]
    assert both == min(alone, key=len)


def _search(spelled: list[bytes], tokens: list[int], strings: list[bytes]) -> bool:
    """The reference: a stop string occurs in the text's bytes and ends after the last
    token's first byte."""
    text = b"".join(spelled[t] for t in tokens)
    start = len(text) - len(spelled[tokens[-1]])
    for s in strings:
        at = text.find(s)
        while at >= 0:
            if at + len(s) > start:
                return True
            at = text.find(s, at + 1)
    return False


def test_matching_equals_a_byte_search():
    rng = random.Random(0)
    match = jax.jit(ends_with_text)
    cases = 0
    for _ in range(60):
        alphabet = rng.choice([b"ab", b"ab.", b"abc \xc3\xa9"])
        spelled = [bytes(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(2, 12))]
        strings = [bytes(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 5))]
        table = text_stops(spelled, strings)
        tokens = [rng.randrange(len(spelled)) for _ in range(12)]
        buffer = jnp.asarray(tokens + [0] * 4, jnp.int32)
        for pos in range(len(tokens)):
            got = bool(match(buffer, jnp.asarray(pos, jnp.int32), table))
            assert got == _search(spelled, tokens[: pos + 1], strings), (spelled, strings, tokens[: pos + 1])
            cases += got
    assert cases > 100  # the random texts do end in stop strings, often


def test_a_special_token_spells_nothing_and_breaks_a_match(tok):
    spelled = tok.token_bytes()
    assert spelled[tok.eos_ids[0]] == b""
    ids = tok.encode("sat on the mat", add_special_tokens=False)
    assert b"".join(spelled[i] for i in ids) == b"sat on the mat"
    table = eqrope.StopStrings(tok, ["the mat"]).table
    split = ids[:-1] + [tok.eos_ids[0], ids[-1]]
    assert bool(ends_with_text(jnp.asarray(ids), jnp.asarray(len(ids) - 1), table))
    assert not bool(ends_with_text(jnp.asarray(split), jnp.asarray(len(split) - 1), table))


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_spell_what_decode_writes(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(tok.token_bytes()[i] for i in ids).decode() == tok.decode(ids)


def test_token_bytes_of_a_sentencepiece_style_tokenizer():
    """Llama 2's layout: `▁` for a space, and `<0xNN>` byte tokens in the vocabulary for
    characters without a token of their own (here `ü` and `∑`)."""
    import json

    import tokenizers
    from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

    def sentencepiece_like(bpe):
        raw = tokenizers.Tokenizer(bpe)
        raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        raw.pre_tokenizer = pre_tokenizers.Split("▁", "merged_with_next")
        raw.decoder = decoders.Sequence([
            decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0),
        ])  # fmt: skip
        return raw

    trained = sentencepiece_like(models.BPE(unk_token="<unk>"))
    trained.train_from_iterator(TEXTS * 4, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    learned = json.loads(trained.to_str())["model"]
    names = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    names += [t for t in sorted(learned["vocab"], key=learned["vocab"].get) if t not in names]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    bpe = models.BPE({t: i for i, t in enumerate(names)}, merges, unk_token="<unk>", byte_fallback=True)
    raw = sentencepiece_like(bpe)
    raw.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok = eqrope.Tokenizer(raw, eos_ids=(2,))
    spelled = tok.token_bytes()
    assert spelled[names.index("<0xE2>")] == b"\xe2"
    for text in TEXTS + ["ünïcödé ∑ ok"]:
        ids = tok.encode(text)
        assert any(3 <= i < 259 for i in ids) == (text == "ünïcödé ∑ ok")
        # Llama 2's decoder strips the text's first space; each token keeps its own.
        assert b"".join(spelled[i] for i in ids).decode() == " " + tok.decode(ids)


def test_no_recompile_for_other_strings(tok, model, free):
    ids, new = free
    strings = _crossing_strings(tok, new, 3)
    eqrope.generate_text(model, tok, PROMPT, NEW)  # compiled without stop strings
    with counting() as c:
        for s in strings:
            eqrope.generate_text(model, tok, PROMPT, NEW, stop=[s])
        eqrope.generate_text(model, tok, PROMPT, NEW, stop=strings[:2])
    assert sum(c.compiles.values()) == 0, c.compiles


def test_min_new_holds_back_stop_strings(tok, model, free):
    ids, new = free
    (s,) = _crossing_strings(tok, new, 1)
    stop = eqrope.StopStrings(tok, [s])
    early = eqrope.generate(model, ids, NEW, stop=[stop], return_logprobs=True)
    end = int(early.lengths) - len(ids)
    held = eqrope.generate(model, ids, NEW, stop=[stop], min_new=end, return_logprobs=True)
    assert int(held.lengths) - len(ids) > end
    assert np.asarray(held.tokens)[len(ids) : len(ids) + end].tolist() == new[:end]


def test_the_uncached_and_speculative_paths_stop_at_the_same_token(tok, model, free):
    ids, new = free
    (s,) = _crossing_strings(tok, new, 1)
    stop = [eqrope.StopStrings(tok, [s])]
    cached = eqrope.generate(model, ids, NEW, stop=stop, return_logprobs=True)
    drafted = eqrope.generate(model, ids, NEW, stop=stop, draft="prompt_lookup", return_logprobs=True)
    uncached = eqrope.generate(Uncached(model), ids, NEW, stop=stop, return_logprobs=True)
    for other in (drafted, uncached):
        assert int(other.lengths) == int(cached.lengths) < len(ids) + NEW
        assert np.array_equal(np.asarray(other.tokens)[: int(other.lengths)], np.asarray(cached.tokens)[: int(cached.lengths)])


def test_refused_with_the_fix(tok, model):
    with pytest.raises(ValueError, match=r"strings\[1\] = ''"):
        eqrope.StopStrings(tok, ["a", ""])
    with pytest.raises(TypeError, match="must be an eqrope.Tokenizer"):
        eqrope.StopStrings(tok.tokenizer, ["a"])
    with pytest.raises(ValueError, match="never match"):
        eqrope.StopStrings(eqrope.Tokenizer(_letters_only()), ["z!"])
    small = random_model(0, vocab_size=64, d_model=16, n_heads=2, n_blocks=1, max_len=16)
    with pytest.raises(ValueError, match=r"stop\[0\] is a StopStrings over a tokenizer of \d+ token ids"):
        eqrope.generate(small, np.asarray([1, 2]), 3, stop=[eqrope.StopStrings(tok, ["a"])])
    engine = eqrope.Engine(model, slots=1, max_len=64, page_size=8)
    with pytest.raises(ValueError, match="built without stop strings; build the Engine with max_stop_strings=1"):
        engine.submit(np.asarray(tok.encode(PROMPT)), eqrope.GenerationConfig(max_new=4, stop=[eqrope.StopStrings(tok, ["a"])]))


def _letters_only():
    import tokenizers
    from tokenizers import models

    return tokenizers.Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))


def test_small_tables_share_the_floor_shape_and_none_is_empty():
    # Small lists share a shape, so that they share a program; no stop strings is a table
    # of no strings, whose program holds no matching.
    small = text_stops([b"a", b"b"], [b"ab", b"ba", b"aab"])
    other = text_stops([b"x"], [b"xx"])
    assert jax.tree.map(np.shape, small) == jax.tree.map(np.shape, other)
    assert np.shape(NO_TEXT_STOPS.target) == (0,) and np.size(NO_TEXT_STOPS.at) == 0
    assert not host_ends_with_text([1, 2, 3], NO_TEXT_STOPS)
