"""What `generate` keeps between calls to cut its fixed cost, and that nothing of it leaks.

Kept: each model object's arrays, tree structure and facts (`_arrays.model_facts`), the
checked settings (`_generation_config.resolve`) and their arrays on the device
(`_request.placed_sampling`). Checked here against the uncached reference path and the
checks themselves: another model object of the same structure generates its own
tokens, a collected model leaves no entry, and a value refused once is still refused
after an equal number of another type was accepted.
"""

import gc
import weakref

import equinox as eqx
import jax
import numpy as np
import pytest

import eqrope
from _models import random_model
from eqrope.generation._arrays import _FACTS, model_facts
from eqrope.testing import Uncached


VOCAB = 31
PROMPT = np.array([3, 1, 4, 1, 5], np.int32)


@pytest.fixture(scope="module")
def models():
    return [random_model(seed, VOCAB, 16, 2, 1, 32, d_ff=32) for seed in (0, 1)]


def test_each_model_object_generates_its_own_tokens(models):
    first, second = models
    # The same structure (one program), other weights; back to the first afterwards.
    tokens = [np.asarray(eqrope.generate(m, PROMPT, 6, max_len=16)) for m in (first, second, first)]
    references = [np.asarray(eqrope.generate(Uncached(m), PROMPT, 6)) for m in (first, second)]
    assert not np.array_equal(references[0], references[1])
    for got, want in zip(tokens, [*references, references[0]]):
        np.testing.assert_array_equal(got, want)
    # A new object with changed weights, made after the first was seen.
    shifted = eqx.tree_at(lambda m: m.head_bias, first, first.head_bias.at[int(tokens[0][5])].add(-50.0))
    np.testing.assert_array_equal(
        np.asarray(eqrope.generate(shifted, PROMPT, 6, max_len=16)),
        np.asarray(eqrope.generate(Uncached(shifted), PROMPT, 6)),
    )


def test_a_collected_model_leaves_no_entry(models):
    model = eqx.tree_at(lambda m: m.head_bias, models[0], models[0].head_bias + 1.0)
    eqrope.generate(model, PROMPT, 2, max_len=16)
    ref = weakref.ref(model)
    assert any(r() is model for r, _ in _FACTS.values())
    del model
    gc.collect()
    assert ref() is None
    assert all(r() is not None for r, _ in _FACTS.values())


def test_a_model_of_tracers_is_not_kept(models):
    """Under `jax.grad` (here any trace) the model's arrays are tracers: walked every call."""
    before, concrete = len(_FACTS), []

    def trace(model):
        concrete.append(model_facts(model).concrete)
        return model.head_bias

    jax.make_jaxpr(trace)(models[1])
    assert concrete == [False] and len(_FACTS) == before


@pytest.mark.parametrize(
    "accepted, refused",
    [(dict(top_k=3), dict(top_k=3.0)), (dict(top_k=1), dict(top_k=True)), (dict(min_new=0), dict(min_new=False))],
)
def test_a_refused_value_stays_refused_after_an_equal_one_was_accepted(models, accepted, refused):
    eqrope.generate(models[0], PROMPT, 3, max_len=16, **accepted)
    name = next(iter(refused))
    with pytest.raises(TypeError, match=name):
        eqrope.generate(models[0], PROMPT, 3, max_len=16, **refused)
