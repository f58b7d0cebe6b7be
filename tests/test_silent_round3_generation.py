"""Issue 27 ("Nothing silent, round 3"), items 1, 2, 3 and 12: generation and text.

1. `PromptLookup(max_ngram=N)`: the n-gram search's program does not grow with `N`, and
   its drafts equal a hand-written lookup's for any `N`.
2. A `BaseException` (`KeyboardInterrupt`, `SystemExit`, `GeneratorExit`) raised by a
   streaming callback reaches the caller as itself, on every path, and the next call works.
3. `bad_ids` with `min_new` masking the only ids left is refused by name.
12. An empty prompt in `generate_text`'s list is refused by its index.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers

import eqrope
from eqrope.generation._generation_config import GenerationConfig
from eqrope.generation._request import parse_request
from eqrope.generation.speculative._prompt_lookup import PromptLookup, lookup_draft
from eqrope.testing import Uncached

from _models import random_model


VOCAB = 96


@pytest.fixture(scope="module")
def model():
    return random_model(0, VOCAB, 32, 2, 1, 64)


# -- 1. prompt lookup's search is bounded by the buffer ---------------------------------------


def hand_lookup(text: list[int], draft_len: int, max_ngram: int, min_ngram: int) -> list[int]:
    """For every earlier position `j`, the common suffix of `text[:j]` and `text`, at most
    `max_ngram` long; the longest (the most recent among equals) proposes `text[j:]`,
    continued by the draft itself."""
    best, start = 0, None
    for j in range(len(text)):
        k = 0
        while k < max_ngram and k < j and text[j - 1 - k] == text[len(text) - 1 - k]:
            k += 1
        if k >= best:
            best, start = k, j
    if best < min_ngram:
        return [text[-1]] * draft_len
    out = list(text)
    for i in range(draft_len):
        out.append(out[start + i])
    return out[len(text) :]


def equations(max_len: int, max_ngram: int) -> int:
    """The size of `lookup_draft`'s program for a `max_len` buffer."""
    lookup = PromptLookup(max_ngram=max_ngram)
    tokens = jnp.zeros((max_len,), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda t, p: lookup_draft(t, p, 4, lookup))(tokens, jnp.int32(3))
    return len(jaxpr.eqns)


def test_prompt_lookup_program_does_not_grow_with_max_ngram():
    # Past the buffer no suffix can match: the program for N = 1000 is the one for the
    # buffer's length, and a long buffer does not unroll its length either.
    bounded = equations(64, 63)
    assert equations(64, 1000) == equations(64, 64) == bounded
    assert equations(64, 10**6) == bounded
    assert equations(4096, 1000) == equations(4096, 100) == bounded


@pytest.mark.parametrize("max_ngram", [1, 3, 8, 9, 31, 32, 1000])
def test_prompt_lookup_matches_a_hand_lookup_for_any_max_ngram(max_ngram):
    rng = np.random.default_rng(max_ngram)
    for min_ngram in sorted({1, min(2, max_ngram), min(max_ngram, 40)}):
        lookup = PromptLookup(max_ngram=max_ngram, min_ngram=min_ngram)
        for trial in range(12):
            length = int(rng.integers(1, 32))
            # Few symbols, or one period repeated: long matches, up to the whole text.
            text = rng.integers(0, 3, length).tolist() if trial % 2 else [5, 6, 7] * 11
            text = text[:length]
            tokens = np.full((32,), 9, np.int32)
            tokens[:length] = text
            got = lookup_draft(jnp.asarray(tokens), jnp.asarray(length, jnp.int32), 6, lookup)
            assert np.asarray(got).tolist() == hand_lookup(text, 6, max_ngram, min_ngram), (text, lookup)


def test_prompt_lookup_with_a_huge_max_ngram_generates_as_greedy():
    # The reproducer: before, N = 1000 unrolled 1000 steps into the program and
    # compiled for over ten minutes. The program size is checked first so that the old
    # code fails here instead of compiling.
    assert equations(16, 1000) == equations(16, 15)
    T = eqrope.RotaryDecoder(64, 32, 2, 2, 128, key=jax.random.key(0))
    prompt = np.arange(1, 9)
    plain = np.asarray(eqrope.generate(T, prompt, 8))
    huge = np.asarray(eqrope.generate(T, prompt, 8, draft=eqrope.PromptLookup(max_ngram=1000)))
    cache = np.asarray(eqrope.generate(T, prompt, 8, draft=eqrope.PromptLookup(max_ngram=16)))
    assert plain.shape == (16,)  # the call's cache holds 16 rows
    np.testing.assert_array_equal(huge, cache)
    np.testing.assert_array_equal(huge, plain)  # speculative greedy is exact


# -- 2. a BaseException from a callback is the caller's ---------------------------------------


STOPS = [KeyboardInterrupt, SystemExit, GeneratorExit]
PATHS = {
    "cached": lambda m: (m, {}),
    "speculative": lambda m: (m, {"draft": "prompt_lookup"}),
    "uncached": lambda m: (Uncached(m), {}),
}


def raising_at(n: int, error: BaseException):
    calls = []

    def on_token(*args):
        calls.append(args)
        if len(calls) == n:
            raise error

    return on_token, calls


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", STOPS)
def test_on_token_base_exception_reaches_the_caller(model, kind, path):
    m, extra = PATHS[path](model)
    prompt = np.arange(1, 7, dtype=np.int32)
    error = kind("stop here")
    on_token, calls = raising_at(2, error)
    with pytest.raises(kind) as raised:
        eqrope.generate(m, prompt, 6, on_token=on_token, **extra)
    assert raised.value is error
    assert len(calls) == 2  # no call after the one that raised
    # The next call streams every token, as one that never failed.
    got = []
    out = np.asarray(eqrope.generate(m, prompt, 6, on_token=lambda *c: got.append(c), **extra))
    assert [(p, t) for _, p, t in got] == [(p, int(out[p])) for p in range(6, 12)]
    np.testing.assert_array_equal(out, np.asarray(eqrope.generate(model, prompt, 6)))


def word_tokenizer(bos: bool) -> eqrope.Tokenizer:
    """A word-level tokenizer as docs/text.md builds one; `bos`: it adds `<s>` in front."""
    words = ["<s>", "</s>", "<pad>", "<unk>"] + [f"w{i}" for i in range(VOCAB - 4)]
    vocab = {w: i for i, w in enumerate(words)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    backend.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins words with spaces
    backend.add_special_tokens(["<s>", "</s>", "<pad>"])
    if bos:
        backend.post_processor = tokenizers.processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", 0)]
        )
    return eqrope.Tokenizer(backend, eos_ids=(1,), pad_id=2)


@pytest.mark.parametrize("path", PATHS)
def test_on_token_that_is_not_a_function_is_refused_by_name(model, path):
    # Under the tests beartype refuses it at `generate`'s annotation; without it, the
    # request's check does, on every path (the uncached one called it: "'int' object is
    # not callable").
    m, extra = PATHS[path](model)
    settings = GenerationConfig(max_new=3)
    with pytest.raises(TypeError, match="on_token must be a function"):
        parse_request(m, np.arange(1, 7, dtype=np.int32), settings, stream=5, **extra)


@pytest.fixture(scope="module")
def tok():
    return word_tokenizer(bos=False)


@pytest.mark.parametrize("path", ["cached", "uncached"])
@pytest.mark.parametrize("kind", STOPS)
def test_generate_text_stream_base_exception_reaches_the_caller(model, tok, kind, path):
    m, _ = PATHS[path](model)
    error = kind("stop here")
    pieces = []

    def stream(row, piece):
        pieces.append(piece)
        raise error

    with pytest.raises(kind) as raised:
        eqrope.generate_text(m, tok, "w1 w2 w3", 5, stream=stream)
    assert raised.value is error
    assert len(pieces) == 1
    got = []
    text = eqrope.generate_text(m, tok, "w1 w2 w3", 5, stream=lambda row, piece: got.append(piece))
    assert text and "".join(got) == text
    assert text == eqrope.generate_text(model, tok, "w1 w2 w3", 5)


# -- 3. nothing left to choose -----------------------------------------------------------------


def test_bad_ids_and_min_new_masking_every_id_are_refused(model):
    prompt = np.arange(1, 9, dtype=np.int32)
    bans = [i for i in range(VOCAB) if i != 7]
    for m in (model, Uncached(model)):
        with pytest.raises(ValueError, match=r"bad_ids.*eos_id.*min_new=3") as raised:
            eqrope.generate(m, prompt, 5, bad_ids=bans, eos_id=7, min_new=3)
        assert "no token" in str(raised.value)
    # Several EOS ids, the min_new from a config.
    bans = [i for i in range(VOCAB) if i not in (7, 9)]
    config = eqrope.GenerationConfig(min_new=1, bad_ids=bans, eos_id=[9, 7])
    with pytest.raises(ValueError, match=r"bad_ids.*eos_id.*min_new=1"):
        eqrope.generate(model, prompt, 5, config=config)
    # Without min_new only the EOS is left, and it ends the row at once.
    out = np.asarray(eqrope.generate(model, prompt, 5, config=config, min_new=0))
    assert out[8] in (7, 9)
    # One more allowed id: min_new makes it the only choice, then the EOS ends the row.
    bans = [i for i in range(VOCAB) if i not in (7, 40)]
    out = np.asarray(eqrope.generate(model, prompt, 5, bad_ids=bans, eos_id=7, min_new=3))
    assert out[8:11].tolist() == [40, 40, 40] and out[11] in (7, 40)


# -- 12. an empty prompt in a list -------------------------------------------------------------


def test_generate_text_refuses_an_empty_prompt_by_index(model, tok):
    with pytest.raises(ValueError, match=r"prompt\[2\] = '' encodes to no tokens") as raised:
        eqrope.generate_text(model, tok, ["w1 w2", "w3", "", "w4"], 3)
    assert "prompt_lengths" not in str(raised.value)
    with pytest.raises(ValueError, match=r"prompt\[0\] = ' ' encodes to no tokens"):
        eqrope.generate_text(model, tok, [" ", "w3"], 3)
    with pytest.raises(ValueError, match=r"generate_text: prompt = '' encodes to no tokens"):
        eqrope.generate_text(model, tok, "", 3)
    # With a BOS, an empty string is a prompt of one token, as in transformers.
    with_bos = word_tokenizer(bos=True)
    assert with_bos.encode("") == [0]
    texts = eqrope.generate_text(model, with_bos, ["w1 w2", ""], 3)
    assert texts[1] == eqrope.generate_text(model, with_bos, "", 3)
