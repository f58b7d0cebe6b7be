"""The small decoder of tests/test_generate*.py (one structure, so that their compiled
programs are shared), its ids, and its plain forward to compare with."""

import equinox as eqx
import jax.numpy as jnp
import numpy as np

from _models import random_model


VOCAB, D_MODEL, HEADS, KV_HEADS, BLOCKS, MAX_LEN, D_FF = 29, 32, 4, 2, 2, 24, 64


def make_model(seed=0, **options):
    sizes = dict(n_kv_heads=KV_HEADS, d_ff=D_FF)
    sizes.update(options)
    max_len = sizes.pop("max_len", MAX_LEN)
    return random_model(seed, VOCAB, D_MODEL, HEADS, BLOCKS, max_len, **sizes)


def i32(x):
    return jnp.asarray(x, jnp.int32)


def random_ids(seed, n):
    return i32(np.random.default_rng(seed).integers(0, VOCAB, size=n))


@eqx.filter_jit
def _full(model, ids):
    return model(ids)


def full(model, ids):
    """`model(ids)`, run padded to `max_len` so that every length shares one compile (the
    model is causal: the first rows do not see the padding)."""
    ids = jnp.asarray(ids, jnp.int32)
    n = ids.shape[0]
    padded = jnp.zeros((model.max_len,), jnp.int32).at[:n].set(ids)
    return _full(model, padded)[:n]


def assert_close(a, b, atol=1e-5):
    np.testing.assert_allclose(
        np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=0, atol=atol
    )
