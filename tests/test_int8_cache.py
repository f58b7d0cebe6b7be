"""The int8 key/value cache: per-row scales, exact byte count, small logit error."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqrope
from eqrope.model._cache import quantize_rows


def test_quantize_rows_by_hand():
    rows = jnp.array([[0.5, -1.27, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]], jnp.float32)
    q, scale = quantize_rows(rows)
    # Row 0: s = 1.27 / 127 = 0.01, so q = round(x / 0.01) = [50, -127, 0, 100].
    np.testing.assert_allclose(np.asarray(scale), [0.01, 1.0], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(q), [[50, -127, 0, 100], [0, 0, 0, 0]])
    assert q.dtype == jnp.int8


@pytest.fixture(scope="module")
def model():
    return eqrope.RotaryDecoder(29, 32, 4, 2, 40, n_kv_heads=2, key=jax.random.PRNGKey(0))


def test_nbytes_formula(model):
    cache = model.init_cache(dtype="int8")
    # 2 (k, v) * 2 blocks * 2 kv heads * 40 rows * (8 int8 values + one float32 scale)
    assert cache.nbytes == 2 * 2 * 2 * 40 * (8 + 4) == eqrope.cache_nbytes(model, dtype="int8")
    assert model.init_cache().nbytes == 2 * 2 * 2 * 40 * 8 * 4 == eqrope.cache_nbytes(model)


def test_int8_steps_track_the_float_path(model):
    ids = jax.random.randint(jax.random.PRNGKey(1), (40,), 0, 29, dtype=jnp.int32)
    full = eqx.filter_jit(lambda m, ids: m(ids))(model, ids)
    cache = model.init_cache(dtype="int8", chunk=16)
    _, cache = eqx.filter_jit(lambda m, ids, c: m.prefill(ids, c))(model, ids[:24], cache)
    step = eqx.filter_jit(lambda m, token, c, t: m.step(token, c, t))  # compiled once
    errors = []
    for t in range(24, 40):
        logits, cache = step(model, ids[t], cache, jnp.int32(t))
        errors.append(float(jnp.max(jnp.abs(logits - full[t]))))
    # Per-row int8 keeps ~2 significant digits; the logits of this model are O(1).
    assert max(errors) < 2e-2
    assert max(errors) > 0  # it really is quantised


def test_float_cache_refuses_wrong_dtype(model):
    bad = eqrope.KVCache(
        keys=jnp.zeros((2, 2, 40, 8), jnp.float16), values=jnp.zeros((2, 2, 40, 8), jnp.float16)
    )
    with pytest.raises(ValueError, match="init_cache"):
        model.step(jnp.int32(1), bad, 0)


@pytest.mark.parametrize("dtype", [None, "int8"])
@pytest.mark.parametrize("batch", [None, 3])
def test_cache_nbytes_of_a_cache_equals_its_arrays_and_the_formula(model, dtype, batch):
    """The call a user writes first, `cache_nbytes(model.init_cache())`, counts the
    cache's own arrays; it agrees with the closed form for the model."""
    cache = model.init_cache(batch, dtype=dtype)
    rows = (cache.keys, cache.values, cache.key_scales, cache.value_scales)
    arrays = sum(x.nbytes for x in rows if x is not None)  # not the `filled` counter
    formula = eqrope.cache_nbytes(model, batch=batch or 1, dtype=dtype)
    assert eqrope.cache_nbytes(cache) == arrays == cache.nbytes == formula
    assert eqrope.cache_nbytes(cache, positions=10) == formula // 4  # 10 of 40 rows
    with pytest.raises(ValueError, match="reads the batch and dtype from the cache"):
        eqrope.cache_nbytes(cache, batch=2)
