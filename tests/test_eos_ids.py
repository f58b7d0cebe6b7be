"""`eos_id` takes one id or a sequence: a row ends after the first of them."""

import jax
import numpy as np
import pytest

import eqrope
from _compiles import counting
from _models import random_model
from eqrope.testing import Uncached


VOCAB = 13


@pytest.fixture(scope="module")
def model():
    return random_model(3, VOCAB, 16, 2, 1, 64, d_ff=32)


def test_a_row_ends_at_the_first_of_several_eos_ids(model):
    prompt = np.array([[1, 2, 3, 4], [5, 6, 7, 8]], np.int32)
    free = np.asarray(eqrope.generate(model, prompt, 20))
    # The ids each row emits first and second: stopping on either ends the row there.
    first, second = int(free[0, 4]), int(free[1, 5])
    eos = [second, first]
    out = eqrope.generate(model, prompt, 20, eos_id=eos, return_logprobs=True)
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    for row in range(2):
        new = free[row, 4:]
        stop = 4 + int(np.flatnonzero(np.isin(new, eos))[0]) + 1  # the EOS token is kept
        assert lengths[row] == stop
        np.testing.assert_array_equal(tokens[row, :stop], free[row, :stop])
        assert (tokens[row, stop:] == eos[0]).all()  # padded with the first EOS id
    plain = eqrope.generate(Uncached(model), prompt, 20, eos_id=eos)
    np.testing.assert_array_equal(tokens, np.asarray(plain))
    # One id behaves as before, as an int or a list of one.
    np.testing.assert_array_equal(
        eqrope.generate(model, prompt, 20, eos_id=first), eqrope.generate(model, prompt, 20, eos_id=[first])
    )


def test_a_new_list_of_the_same_length_compiles_nothing(model):
    prompt = np.array([1, 2, 3], np.int32)
    eqrope.generate(model, prompt, 10, eos_id=[1, 2, 3])
    # The key is made outside the count: its own seeding program may not be compiled yet
    # in this worker (conftest clears JAX's caches between modules), and is not generate's.
    key = jax.random.key(0)
    with counting() as c:
        for eos in ([4, 5, 6], [7, 8, 9], (0, 12, 11)):
            eqrope.generate(model, prompt, 10, eos_id=eos, temperature=0.7, key=key)
            eqrope.generate(model, prompt, 10, eos_id=eos)
    assert sum(c.compiles.values()) == 0, dict(c.compiles)


@pytest.mark.parametrize(
    "eos_id, error, match",
    [
        ([], ValueError, "eos_id is an empty sequence"),
        ([1, VOCAB], ValueError, r"eos_id\[1\] must be a token id"),
        ([1, 2.0], TypeError, r"eos_id"),
    ],
)
def test_bad_eos_lists(model, eos_id, error, match):
    with pytest.raises(error, match=match):
        eqrope.generate(model, np.array([1, 2], np.int32), 3, eos_id=eos_id)
