"""`eqrope.cross_entropy`'s targets: `ignore_id` positions are left out, any other target
outside the vocabulary raises, eagerly and under `jit`."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqrope
from _models import random_model


VOCAB, SEQ = 11, 6


@pytest.fixture(scope="module")
def model():
    return random_model(0, VOCAB, 16, 2, 1, SEQ)


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, (3, SEQ)).astype(np.int32)
    targets = rng.integers(0, VOCAB, (3, SEQ)).astype(np.int32)
    return ids, targets


def _by_hand(model, ids, targets, keep):
    """The mean negative log-likelihood over `keep`, with a float64 NumPy log-softmax."""
    logits = np.asarray(jax.vmap(model)(jnp.asarray(ids)), np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    rows, cols = np.nonzero(keep)
    return -logp[rows, cols, targets[rows, cols]].mean()


def test_ignored_targets_are_left_out_of_the_mean(model):
    ids, targets = _batch()
    targets[0, :2] = -100
    targets[2, 5] = -100
    keep = targets != -100
    expected = _by_hand(model, ids, targets, keep)
    got = eqrope.cross_entropy(model, jnp.asarray(ids), jnp.asarray(targets))
    assert np.isfinite(float(got))
    np.testing.assert_allclose(float(got), expected, rtol=1e-5)
    # The same under jit, and combined with a mask (both must keep a position).
    jitted = eqx.filter_jit(eqrope.cross_entropy)(model, jnp.asarray(ids), jnp.asarray(targets))
    np.testing.assert_allclose(float(jitted), expected, rtol=1e-5)
    mask = np.ones_like(keep)
    mask[1, 3:] = False
    both = eqrope.cross_entropy(model, jnp.asarray(ids), jnp.asarray(targets), jnp.asarray(mask))
    np.testing.assert_allclose(float(both), _by_hand(model, ids, targets, keep & mask), rtol=1e-5)


def test_another_ignore_id(model):
    ids, targets = _batch(1)
    targets[1, 1:4] = 0
    got = eqrope.cross_entropy(model, jnp.asarray(ids), jnp.asarray(targets), ignore_id=0)
    np.testing.assert_allclose(float(got), _by_hand(model, ids, targets, targets != 0), rtol=1e-5)
    # ignore_id=None ignores nothing, so -100 is then out of range.
    targets[0, 0] = -100
    with pytest.raises(ValueError, match=r"targets holds token ids outside \[0, 11\): \[-100\]"):
        eqrope.cross_entropy(model, jnp.asarray(ids), jnp.asarray(targets), ignore_id=None)
    with pytest.raises(TypeError, match="ignore_id"):
        eqrope.cross_entropy(model, jnp.asarray(ids), jnp.asarray(targets), ignore_id=-1.0)


@pytest.mark.parametrize("bad", [-1, -101, VOCAB, 1000])
def test_targets_outside_the_vocabulary_raise_eagerly(model, bad):
    ids, targets = _batch()
    targets[1, 2] = bad
    with pytest.raises(ValueError, match=rf"targets holds token ids outside \[0, 11\): \[{bad}\]"):
        eqrope.cross_entropy(model, jnp.asarray(ids), jnp.asarray(targets))


@pytest.mark.parametrize("bad", [-1, VOCAB])
def test_targets_outside_the_vocabulary_raise_under_jit(model, bad):
    ids, targets = _batch()
    targets[1, 2] = bad
    loss = eqx.filter_jit(eqrope.cross_entropy)
    message = r"targets holds a token id outside \[0, vocab_size=11\)"
    with pytest.raises(eqx.EquinoxRuntimeError, match=message):
        jax.block_until_ready(loss(model, jnp.asarray(ids), jnp.asarray(targets)))
    # The ignored id passes under jit too.
    targets[1, 2] = -100
    assert np.isfinite(float(loss(model, jnp.asarray(ids), jnp.asarray(targets))))


def test_train_step_refuses_bad_targets(model):
    optimizer = optax.sgd(0.1)
    step, state = eqrope.make_train_step(optimizer), eqrope.init_optimizer(optimizer, model)
    ids, targets = _batch()
    targets[0, 0] = -1
    with pytest.raises(eqx.EquinoxRuntimeError, match="targets holds a token id outside"):
        jax.block_until_ready(step(model, state, jnp.asarray(ids), jnp.asarray(targets)))
