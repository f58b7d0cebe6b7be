"""`_threefry`'s unrolled draw against `jax.random` itself, bit for bit: key folding, random
bits, Gumbel noise and the categorical draw, for many keys and positions, typed and raw
keys, under `jit` and `vmap`, in x32 and x64; other keys and a JAX without the hash fall
back to `jax.random`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqrope.generation import _threefry

pytestmark = pytest.mark.usefixtures("precision")

SEEDS = np.array([0, 1, 42, 7919, 2**31 - 1], np.int32)
POSITIONS = np.array([0, 1, 2, 255, 2**16 + 3, 2**31 - 1], np.int32)
MAKERS = {"key": jax.random.key, "PRNGKey": jax.random.PRNGKey}


def reference_draw(key, position, logits):
    return jax.random.categorical(jax.random.fold_in(key, position), logits)


def data_of(key):
    return jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key


@pytest.mark.parametrize("maker", MAKERS)
def test_fold_in_is_jax_random_fold_in(maker):
    make = MAKERS[maker]
    got = jax.jit(jax.vmap(jax.vmap(
        lambda s, p: _threefry.fold_in(_threefry.threefry_data(make(s)), p), (None, 0)), (0, None)
    ))(SEEDS, POSITIONS)  # fmt: skip
    want = jax.vmap(jax.vmap(lambda s, p: data_of(jax.random.fold_in(make(s), p)), (None, 0)), (0, None))(
        SEEDS, POSITIONS
    )
    np.testing.assert_array_equal(got, want)
    assert got.dtype == np.uint32 and got.shape == (len(SEEDS), len(POSITIONS), 2)


@pytest.mark.parametrize("n", [1, 65, 512])
def test_bits_and_gumbel_are_jax_randoms(n):
    make = jax.random.key  # raw keys share the data path (`test_fold_in_...`)
    mine = jax.jit(jax.vmap(lambda s: (
        _threefry.bits(_threefry.threefry_data(make(s)), n), _threefry.gumbel(_threefry.threefry_data(make(s)), n)
    )))(SEEDS)  # fmt: skip
    theirs = jax.vmap(lambda s: (
        jax.random.bits(make(s), (n,), jnp.uint32), jax.random.gumbel(make(s), (n,), jnp.float32)
    ))(SEEDS)  # fmt: skip
    np.testing.assert_array_equal(mine[0], theirs[0])
    assert mine[1].dtype == np.float32
    np.testing.assert_array_equal(np.asarray(mine[1]).view(np.uint32), np.asarray(theirs[1]).view(np.uint32))


def logits_with_holes(vocab):
    """Spread float32 logits with -inf entries (every third, never all)."""
    logits = 4 * jax.random.normal(jax.random.key(vocab), (vocab,), jnp.float32)
    return logits.at[1::3].set(-jnp.inf)


@pytest.mark.parametrize("maker", MAKERS)
@pytest.mark.parametrize("vocab", [1, 2, 257])
def test_draw_is_categorical_of_fold_in(maker, vocab):
    make = MAKERS[maker]
    logits = logits_with_holes(vocab)
    pairs = lambda draw: jax.jit(jax.vmap(jax.vmap(
        lambda s, p: draw(make(s), p, logits), (None, 0)), (0, None)
    ))(SEEDS, POSITIONS)  # fmt: skip
    got, want = pairs(_threefry.draw_token), pairs(reference_draw)
    np.testing.assert_array_equal(got, want)
    assert got.dtype == want.dtype
    assert np.all(np.isfinite(np.asarray(logits)[np.asarray(got)]))  # never a masked entry
    if vocab == 257:  # the draws are spread, not one token
        assert len(np.unique(np.asarray(got))) > 10


def test_draw_outside_jit_one_key():
    key, logits = jax.random.key(3), logits_with_holes(65)
    for position in (0, 9, 2**31 - 1):
        assert int(_threefry.draw_token(key, jnp.int32(position), logits)) == int(
            reference_draw(key, position, logits)
        )


def test_other_key_implementations_use_jax_random():
    key, logits = jax.random.key(5, impl="rbg"), logits_with_holes(65)
    assert _threefry.threefry_data(key) is None
    got = jax.jit(jax.vmap(lambda p: _threefry.draw_token(key, p, logits)))(POSITIONS)
    want = jax.vmap(lambda p: reference_draw(key, p, logits))(POSITIONS)
    np.testing.assert_array_equal(got, want)


def test_a_jax_without_the_hash_uses_jax_random(monkeypatch):
    monkeypatch.setattr(_threefry, "_threefry2x32_lowering", None)
    key, logits = jax.random.key(11), logits_with_holes(65)
    assert _threefry.threefry_data(key) is None
    got = jax.vmap(lambda p: _threefry.draw_token(key, p, logits))(POSITIONS)
    np.testing.assert_array_equal(got, jax.vmap(lambda p: reference_draw(key, p, logits))(POSITIONS))


def test_high_dynamic_range_noise_uses_jax_random():
    key, logits = jax.random.key(13), logits_with_holes(65)
    before = jax.config.jax_high_dynamic_range_gumbel
    jax.config.update("jax_high_dynamic_range_gumbel", True)
    try:
        assert _threefry.threefry_data(key) is None
        got = jax.vmap(lambda p: _threefry.draw_token(key, p, logits))(POSITIONS)
        want = jax.vmap(lambda p: reference_draw(key, p, logits))(POSITIONS)
    finally:
        jax.config.update("jax_high_dynamic_range_gumbel", before)
    np.testing.assert_array_equal(got, want)
