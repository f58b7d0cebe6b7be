"""Regression tests for failures that were silent in `generate`, `prefill` and `step`.

Each test here failed (ran on, wrapped, or raised a raw error) before its fix: integer
inputs wrapping to int32, keys of another PRNG implementation, huge `max_new`/`top_k`,
NaN logits sampled as token 0, calls under `jax.jit`, weak messages, and steps past the
cache's filled rows.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqrope
from _models import random_model
from eqrope.testing import Uncached


pytestmark = pytest.mark.usefixtures("precision")

VOCAB, MAX_LEN = 13, 24


@pytest.fixture(scope="module")
def model():
    return random_model(0, VOCAB, 16, 2, 1, MAX_LEN, d_ff=32)


# -- 2. integers are range-checked in their own dtype, never wrapped ----------------------------


@pytest.mark.parametrize(
    "prompt, shown",
    [
        (np.array([2**32 + 5, 1], np.int64), "4294967301"),
        (np.array([2**31 + 5, 1], np.uint32), "2147483653"),
        ([2**40, 1], "1099511627776"),
        ([2**70, 1], "too large even for int64"),
    ],
)
def test_prompt_ids_do_not_wrap(model, prompt, shown):
    with pytest.raises(ValueError, match=f"prompt holds integers outside the int32 range.*{shown}"):
        eqrope.generate(model, prompt, 3)


def test_prompt_lengths_and_positions_do_not_wrap(model):
    with pytest.raises(ValueError, match="prompt_lengths holds integers outside the int32 range"):
        eqrope.generate(model, np.ones((2, 3), np.int32), 2, prompt_lengths=np.array([2**32 + 2, 3]))
    cache = model.init_cache()
    for pos in (np.int64(2**32 + 3), 2**40, 2**70):
        with pytest.raises(ValueError, match="pos .*outside the int32 range"):
            model.step(jnp.int32(1), cache, pos)
    with pytest.raises(ValueError, match="token holds integers outside the int32 range"):
        model.step(np.int64(2**32 + 1), cache, 0)


# -- 4. keys of every PRNG implementation --------------------------------------------------------


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_every_prng_implementation_works(model, impl):
    previous = jax.config.jax_default_prng_impl
    jax.config.update("jax_default_prng_impl", impl)
    try:
        prompt = np.array([1, 2, 3], np.int32)
        greedy = eqrope.generate(model, prompt, 5)
        np.testing.assert_array_equal(greedy, eqrope.generate(Uncached(model), prompt, 5))
        for key in (jax.random.key(4), jax.random.PRNGKey(4)):
            sampled = eqrope.generate(model, prompt, 5, temperature=1.0, key=key)
            again = eqrope.generate(Uncached(model), prompt, 5, temperature=1.0, key=key)
            np.testing.assert_array_equal(sampled, again)
    finally:
        jax.config.update("jax_default_prng_impl", previous)


# -- 6. any int for max_new and top_k ------------------------------------------------------------


def test_huge_max_new_and_top_k(model):
    prompt = np.array([1, 2, 3], np.int32)
    with pytest.warns(eqrope.TruncationWarning):  # the cache holds 21 of them
        assert eqrope.generate(model, prompt, 2**31).shape == (MAX_LEN,)
        assert eqrope.generate(model, prompt, 2**70).shape == (MAX_LEN,)
    key = jax.random.key(1)
    every = eqrope.generate(model, prompt, 6, temperature=1.0, key=key)
    for top_k in (2**31, 2**70):
        np.testing.assert_array_equal(
            every, eqrope.generate(model, prompt, 6, temperature=1.0, top_k=top_k, key=key)
        )


# -- 7. non-finite logits are reported -----------------------------------------------------------


@pytest.mark.parametrize("value", [jnp.nan, jnp.inf])
def test_non_finite_logits_raise(model, value):
    broken = eqx.tree_at(lambda m: m.head_bias, model, model.head_bias.at[3].set(value))
    prompt = np.array([1, 2, 3], np.int32)
    for m in (broken, Uncached(broken)):
        with pytest.raises(FloatingPointError, match="non-finite logits.*check_finite=False"):
            eqrope.generate(m, prompt, 4)
    batch = np.stack([prompt, prompt])
    with pytest.raises(FloatingPointError, match="non-finite logits"):
        eqrope.generate(broken, batch, 4, temperature=1.0, key=jax.random.key(0))
    assert eqrope.generate(broken, prompt, 4, check_finite=False).shape == (7,)


# -- 9. weak messages made clear -----------------------------------------------------------------


def test_generate_under_a_transformation_says_it_is_compiled_already(model):
    prompt = jnp.array([1, 2, 3], jnp.int32)
    message = "already one compiled program"
    with pytest.raises(TypeError, match=message):
        jax.jit(lambda p: eqrope.generate(model, p, 3))(prompt)
    with pytest.raises(TypeError, match=message):
        jax.vmap(lambda p: eqrope.generate(model, p, 3))(jnp.stack([prompt, prompt]))
    with pytest.raises(TypeError, match=message):
        eqx.filter_jit(lambda m: eqrope.generate(m, prompt, 3))(model)


# A list is one temperature per row of a batch (tests/test_per_row_settings.py).
@pytest.mark.parametrize("temperature", ["hot", None, {"value": 1.0}])
def test_temperature_of_the_wrong_type(model, temperature):
    # Under pytest's runtime type checks the annotation refuses it first, naming it too.
    with pytest.raises(TypeError, match="temperature"):
        eqrope.generate(model, np.array([1, 2], np.int32), 3, temperature=temperature)


def test_top_p_takes_numpy_and_jax_scalars(model):
    prompt, key = np.array([1, 2], np.int32), jax.random.key(2)
    want = eqrope.generate(model, prompt, 5, temperature=1.0, top_p=0.5, key=key)
    for top_p in (np.float32(0.5), jnp.float32(0.5), np.float64(0.5), jnp.asarray(0.5)):
        got = eqrope.generate(model, prompt, 5, temperature=1.0, top_p=top_p, key=key)
        np.testing.assert_array_equal(want, got)
    with pytest.raises(TypeError, match="top_p"):
        eqrope.generate(model, prompt, 5, top_p="0.5")


def test_int8_keys_with_float_values_is_refused_by_message(model):
    good = model.init_cache(dtype="int8")
    mixed = eqrope.KVCache(
        keys=good.keys, values=jnp.zeros(good.values.shape, jnp.float32), key_scales=good.key_scales
    )
    with pytest.raises(ValueError, match="cache has dtype int8.*init_cache"):
        model.step(jnp.int32(1), mixed, 0)


def test_empty_one_dimensional_prompt_is_reported_as_itself(model):
    with pytest.raises(ValueError, match=r"prompt is empty \(shape \(0,\)\)"):
        eqrope.generate(model, np.zeros((0,), np.int32), 3)


# -- 10. positions must be consecutive: the cache knows its filled rows --------------------------


def test_a_step_past_the_filled_rows_is_refused(model):
    ids = jnp.array([1, 2, 3, 4, 5, 6, 7, 8], jnp.int32)
    _, cache = model.prefill(ids, model.init_cache())
    assert int(cache.filled) == 8
    with pytest.raises(ValueError, match=r"pos=10 leaves a gap.*filled=8"):
        model.step(jnp.int32(1), cache, 10)
    step = eqx.filter_jit(lambda m, t, c, p: m.step(t, c, p))
    with pytest.raises(eqx.EquinoxRuntimeError, match="gap"):
        step(model, jnp.int32(1), cache, jnp.int32(10))
    # The next position, and rewinding to an earlier one, are fine.
    logits, after = step(model, jnp.int32(9), cache, jnp.int32(8))
    assert int(after.filled) == 9
    np.testing.assert_allclose(logits, model(jnp.append(ids, 9))[-1], atol=1e-5)
    rewound, _ = model.prefill(ids[5:], cache, 5)
    np.testing.assert_allclose(rewound, model(ids)[5:], atol=1e-5)
