"""A decode loop written by hand: `init_cache`, `prefill`, `step`, each compiled once.

The seed's page loops `m.step_static(ids[t], c, t)` with a Python int `t`, outside any
`jit`. eqrope's `step` and `prefill`, called that way, run as one compiled program per
shape, with the position turned into an array before it: a new position, a new cache or a
new prompt of the same length compiles nothing. Compiles are counted from the test side
(`_compiles.counting`), and the logits are checked against the full pass.
"""

import copy
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _compiles import counting

import eqrope


# Sizes of their own, so that no other test of the process has compiled these programs.
SIZES = (67, 32, 4, 2, 40)


@pytest.fixture(scope="module", params=["stacked", "unstacked"])
def model(request):
    m = eqrope.RotaryDecoder(*SIZES, key=jax.random.PRNGKey(3))
    return m.with_layout(request.param)


def test_the_seeds_loop_compiles_once(model):
    ids = jnp.arange(16, dtype=jnp.int32) * 3 % SIZES[0]
    full = model(ids)
    c = model.init_cache()
    with counting() as first:
        for t in range(8):  # word for word the seed's loop
            last, c = model.step(ids[t], c, t)
    np.testing.assert_allclose(last, full[7], atol=1e-5)
    with counting() as later:  # eight new positions on the same cache, then a new cache
        for t in range(8, 16):
            last, c = model.step(ids[t], c, t)
        again, _ = model.step(ids[0], model.init_cache(), 0)
    np.testing.assert_allclose(last, full[15], atol=1e-5)
    np.testing.assert_allclose(again, full[0], atol=1e-5)
    assert first.compiles["jit(_prefill_compiled)"] <= 1, first.compiles
    assert sum(first.compiles.values()) <= 4, first.compiles  # the step, ids[t], logits[0]
    assert sum(later.compiles.values()) == 0, later.compiles


def test_prefill_compiles_once_per_length(model):
    ids = jnp.arange(16, dtype=jnp.int32) * 5 % SIZES[0]
    full = model(ids)
    model.prefill(ids[:6], model.init_cache())
    with counting() as later:  # the same length again: another prompt, another cache, a position
        logits, c = model.prefill(ids[6:12], model.init_cache())
        tail, _ = model.prefill(ids[6:12], model.prefill(ids[:6], model.init_cache())[1], 6)
    np.testing.assert_allclose(logits, model(ids[6:12]), atol=1e-5)
    np.testing.assert_allclose(tail, full[6:12], atol=1e-5)
    assert int(c.filled) == 6
    assert sum(later.compiles.values()) == 0, later.compiles


def test_model_generate_names_the_functions():
    model = eqrope.RotaryDecoder(*SIZES, key=jax.random.PRNGKey(3))
    ids = jnp.arange(4, dtype=jnp.int32)
    with pytest.raises(AttributeError, match=r"eqrope\.generate\(model, ids, 5\)") as info:
        model.generate(ids, 5)
    assert "eqrope.generate_text(model, tokenizer" in str(info.value)
    assert info.value.name == "generate" and info.value.obj is model
    with pytest.raises(AttributeError, match=r"no method 'generate_text'.*eqrope\.generate_text\("):
        model.generate_text
    # Nothing else changes: hasattr, other missing names, copies, pickling and tree ops.
    assert not hasattr(model, "generate") and hasattr(model, "step")
    with pytest.raises(AttributeError, match=r"^'RotaryDecoder' object has no attribute 'genrate'$"):
        model.genrate
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model)), jax.tree.map(lambda x: x, model)):
        np.testing.assert_array_equal(twin(ids), model(ids))
