"""The cache length is chosen per `generate` call, and a job costs what its tokens cost.

A model built for 131072 positions (what a Llama-3 config gives) must not allocate, or
loop over, 131072 cache rows to add 10 tokens to a prompt of 8. The checks are structural
(the rows the program asks for, the steps it runs, the compiles it triggers), never timed.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqrope
from _compiles import counting
from _models import random_model
from eqrope.generation._request import cache_rows
from test_generate_work import CACHE_ROWS, EXECUTED, CountingDecoder


VOCAB, D_MODEL, HEADS, BLOCKS = 29, 16, 2, 1


def make(max_len, seed=0):
    return random_model(seed, VOCAB, D_MODEL, HEADS, BLOCKS, max_len, d_ff=32)


def prompt(n, seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, n).astype(np.int32)


@pytest.mark.parametrize(
    "seq, max_new, model_max_len, expected",
    [
        (8, 10, 131072, 32),  # 18 tokens: the next power of two
        (8, 8, 131072, 16),  # exactly a power of two
        (1, 1, 131072, 16),  # at least 16
        (8, 100, 256, 128),  # the seed protocol
        (200, 100, 256, 256),  # capped at the model's max_len
        (3, 0, 8, 8),  # capped below 16
    ],
)
def test_default_cache_length_by_hand(seq, max_new, model_max_len, expected):
    assert cache_rows(seq, max_new, model_max_len, None) == expected
    assert cache_rows(seq, max_new, model_max_len, model_max_len) == model_max_len


def test_long_max_len_model_asks_for_a_short_cache_and_runs_only_its_steps():
    """10 tokens after 8 on a 131072-position model: the program asks for 32 cache rows
    and runs 9 model steps (none after the last token); the tokens equal those of the same
    weights at max_len 256."""
    big, small = make(131072), make(256)
    CACHE_ROWS.clear()
    EXECUTED.clear()
    out = eqrope.generate(CountingDecoder(big), prompt(8), 10)
    jax.effects_barrier()
    assert CACHE_ROWS == [32]  # one trace, one cache of 32 rows (not 131072)
    assert [kind for kind, _ in EXECUTED].count("step") == 10 - 1
    np.testing.assert_array_equal(np.asarray(out), np.asarray(eqrope.generate(small, prompt(8), 10)))


def test_explicit_max_len_pins_the_cache_and_caps_the_text():
    model = make(64)
    CACHE_ROWS.clear()
    pinned = eqrope.generate(CountingDecoder(model), prompt(5), 7, max_len=64)
    assert CACHE_ROWS == [64]
    np.testing.assert_array_equal(np.asarray(pinned), np.asarray(eqrope.generate(model, prompt(5), 7)))
    # A cache of 9 rows holds 9 positions: 5 of prompt and 4 new tokens.
    with pytest.warns(eqrope.TruncationWarning, match="max_len=9 holds 4 new tokens"):
        short = eqrope.generate(model, prompt(5), 7, max_len=9)
    assert short.shape == (9,)
    np.testing.assert_array_equal(np.asarray(short), np.asarray(pinned[:9]))


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_default_and_pinned_lengths_give_the_same_text(temperature):
    model = make(256)
    key = jax.random.key(3) if temperature else None
    batch = np.stack([prompt(6, 1), prompt(6, 2)])
    kwargs = dict(temperature=temperature, key=key, prompt_lengths=np.array([6, 3], np.int32))
    default = eqrope.generate(model, batch, 20, return_logprobs=True, **kwargs)
    pinned = eqrope.generate(model, batch, 20, max_len=256, return_logprobs=True, **kwargs)
    np.testing.assert_array_equal(np.asarray(default.tokens), np.asarray(pinned.tokens))
    np.testing.assert_allclose(np.asarray(default.logprobs), np.asarray(pinned.logprobs), atol=1e-5)


def test_nothing_compiles_within_one_cache_length():
    """New prompt lengths, `max_new` values and sampling settings that share a cache
    length compile nothing at all: no new program, no small eager op."""
    model = make(256)
    key = jax.random.key(0)
    eqrope.generate(model, prompt(8), 100)  # 108 tokens: 128 rows
    eqrope.generate(model, prompt(8), 100, temperature=1.0, key=key, return_logprobs=True)
    calls = [
        dict(n=3, max_new=70),
        dict(n=20, max_new=100),
        dict(n=8, max_new=90, temperature=0.5, key=jax.random.key(7)),
        dict(n=30, max_new=65, temperature=1.5, top_k=3, top_p=0.7, key=key),
        dict(n=5, max_new=100, eos_id=4, return_logprobs=True),
    ]
    with counting() as c:
        for call in calls:
            call = dict(call)
            eqrope.generate(model, prompt(call.pop("n")), call.pop("max_new"), **call)
    assert sum(c.compiles.values()) == 0, dict(c.compiles)


def test_shorter_cache_protocol_equals_the_full_forward():
    model = make(256)
    ids = jnp.asarray(prompt(20))
    full = model(ids)
    cache = model.init_cache(max_len=24)
    assert cache.keys.shape[-2] == 24 and eqrope.cache_nbytes(cache) * 256 == eqrope.cache_nbytes(model) * 24
    logits, cache = model.prefill(ids[:12], cache)
    np.testing.assert_allclose(logits, full[:12], atol=1e-5)
    step = eqx.filter_jit(lambda m, token, c, t: m.step(token, c, t))  # compiled once
    for t in range(12, 20):
        logits, cache = step(model, ids[t], cache, jnp.int32(t))
        np.testing.assert_allclose(logits, full[t], atol=1e-5)
    with pytest.raises(ValueError, match=r"pos \+ sequence length must be within max_len=24"):
        model.prefill(ids[:8], cache, 20)


@pytest.mark.parametrize(
    "max_len, error, match",
    [
        (300, ValueError, r"max_len=300, but the model's max_len is 256"),
        (4, ValueError, r"max_len=4 cache rows cannot hold the prompt's 6 tokens"),
        (0, ValueError, r"max_len must be a positive int"),
        (True, TypeError, r"max_len must be a positive int"),
        (16.0, TypeError, r"max_len"),
    ],
)
def test_bad_max_len(max_len, error, match):
    model = make(256)
    with pytest.raises(error, match=match):
        eqrope.generate(model, prompt(6), 4, max_len=max_len)
    if max_len != 4:
        with pytest.raises((TypeError, ValueError), match=r"max_len"):
            model.init_cache(max_len=max_len)
