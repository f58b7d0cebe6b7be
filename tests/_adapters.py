"""Adapted models for the adapter tests, with factors drawn by NumPy (no compiles)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import eqrope
from _models import random_model


SIZES = (53, 32, 4, 2, 64)  # vocab, d_model, heads, blocks, max_len
ALL = ("q", "k", "v", "o", "gate", "up", "down")


def base(seed=0, **options):
    options.setdefault("n_kv_heads", 2)
    return random_model(seed, *SIZES, **options)


def perturbed(model, seed=1, scale=0.3):
    """`model` with every adapter's `B` (and `A`) redrawn, so that each update is non-zero."""
    rng = np.random.default_rng(seed)

    def redraw(x):
        if not isinstance(x, eqrope.LowRank):
            return x
        a = jnp.asarray(rng.normal(size=x.a.shape) / np.sqrt(x.a.shape[-2]), x.a.dtype)
        b = jnp.asarray(scale * rng.normal(size=x.b.shape), x.b.dtype)
        return eqx.tree_at(lambda p: (p.a, p.b), x, (a, b))

    return jax.tree.map(redraw, model, is_leaf=lambda x: isinstance(x, eqrope.LowRank))


def adapted(seed=0, targets=ALL, rank=4, alpha=8.0, model=None, **kwargs):
    model = base() if model is None else model
    fresh = eqrope.lora(model, rank=rank, alpha=alpha, targets=targets, key=jax.random.key(seed), **kwargs)
    return perturbed(fresh, seed + 100)


def ids(n, seed=0, vocab=SIZES[0]):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, n), jnp.int32)


def bitwise_equal(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        x.dtype == y.dtype and np.asarray(x).tobytes() == np.asarray(y).tobytes() for x, y in zip(la, lb)
    )


@eqx.filter_jit
def call(model, x):
    """`model(x)`, compiled (one program per model structure, instead of op by op)."""
    return model(x)
