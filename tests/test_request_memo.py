"""A repeated `generate` call reuses its checked request (`_request_memo.py`): the same
tokens as a call checked anew, its own key, every refusal and warning still raised."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqrope
from _models import random_model
from eqrope.generation import _request_memo


@pytest.fixture(scope="module")
def model():
    return random_model(0, 31, 16, 2, 1, 32)


@pytest.fixture
def parses(monkeypatch):
    """The calls that checked their arguments (`parse_request` ran)."""
    calls = []
    original = _request_memo.parse_request

    def counting(*args, **kwargs):
        calls.append(args[1])
        return original(*args, **kwargs)

    monkeypatch.setattr(_request_memo, "parse_request", counting)
    monkeypatch.setattr(_request_memo, "_KEPT", type(_request_memo._KEPT)())
    return calls


def test_a_repeated_call_is_checked_once_and_gives_the_same_tokens(model, parses):
    prompt = jnp.arange(5, dtype=jnp.int32)
    first = eqrope.generate(model, prompt, 6)
    again = eqrope.generate(model, prompt, 6)
    assert len(parses) == 1
    # A NumPy prompt (mutable) is checked every call; it gives the same tokens.
    fresh = eqrope.generate(model, np.arange(5, dtype=np.int32), 6)
    assert len(parses) == 2
    np.testing.assert_array_equal(first, again)
    np.testing.assert_array_equal(first, fresh)


def test_each_call_samples_with_its_own_key(model, parses):
    prompt = jnp.arange(4, dtype=jnp.int32)
    settings = dict(temperature=1.5, top_k=20)
    keys = [jax.random.key(i) for i in range(3)]
    kept = [eqrope.generate(model, prompt, 12, key=k, **settings) for k in keys]
    assert len(parses) == 1
    fresh = [eqrope.generate(model, np.asarray(prompt), 12, key=k, **settings) for k in keys]
    for a, b in zip(kept, fresh):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(kept[0], kept[1])  # the keys were not dropped
    # Without a key, sampling is still refused.
    with pytest.raises(ValueError, match="pass key="):
        eqrope.generate(model, prompt, 12, **settings)


def test_other_settings_are_other_calls(model, parses):
    prompt = jnp.arange(4, dtype=jnp.int32)
    short = eqrope.generate(model, prompt, 3)
    longer = eqrope.generate(model, prompt, 5)
    assert (short.shape, longer.shape) == ((7,), (9,))
    eqrope.generate(model, prompt, 3, eos_id=[1, 2])
    eqrope.generate(model, prompt, 3, max_len=16)
    assert len(parses) == 4
    with pytest.raises(ValueError, match="bad_ids"):
        eqrope.generate(model, prompt, 3, bad_ids=[99])


def test_the_truncation_warning_comes_every_call(model, parses):
    prompt = jnp.arange(30, dtype=jnp.int32)
    for _ in range(2):
        with pytest.warns(eqrope.TruncationWarning, match="will not be generated"):
            eqrope.generate(model, prompt, 8)
    assert len(parses) == 1


def test_a_new_prompt_at_a_dead_ones_address_is_checked(model, parses, monkeypatch):
    """An entry holds its prompt and model weakly: a new array at a collected one's address
    (every address the same here) is never taken for it."""
    monkeypatch.setattr(_request_memo, "id", lambda obj: 0, raising=False)
    for n in range(3):
        prompt = jnp.full((3,), n + 1, jnp.int32)
        assert eqrope.generate(model, prompt, 2)[:3].tolist() == [n + 1] * 3
        assert eqrope.generate(model, prompt, 2)[:3].tolist() == [n + 1] * 3
        del prompt
    other = random_model(1, 31, 16, 2, 1, 32)
    prompt = jnp.full((3,), 7, jnp.int32)
    ours, theirs = eqrope.generate(model, prompt, 4), eqrope.generate(other, prompt, 4)
    assert len(parses) == 5
    np.testing.assert_array_equal(theirs, eqrope.generate(other, np.asarray(prompt), 4))
    assert not np.array_equal(ours, theirs)


def test_the_kept_calls_are_bounded_and_refusals_are_not_kept(model, parses):
    for n in range(_request_memo._KEPT_CALLS + 8):
        eqrope.generate(model, jnp.full((3,), n % 31, jnp.int32), 2)
    assert len(_request_memo._KEPT) == _request_memo._KEPT_CALLS
    bad = jnp.array([1, 2, 99], jnp.int32)  # outside the vocabulary
    for _ in range(2):
        with pytest.raises(ValueError, match="outside"):
            eqrope.generate(model, bad, 2)
    assert len(_request_memo._KEPT) == _request_memo._KEPT_CALLS


def test_calls_with_arrays_of_their_own_are_checked_every_time(model, parses):
    prompt = jnp.zeros((2, 4), jnp.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            eqrope.generate(model, prompt, 2, prompt_lengths=[2, 4])
            eqrope.generate(model, prompt, 2, temperature=[0.0, 0.5], key=jax.random.key(0))
    assert len(parses) == 4
