"""A one-sequence model function over the rows of a batch, and the batch's cache.

`jax.vmap` of a step over one row still costs the batched program: on the CPU a batch of
one made a seed-sized decode step about three times slower than the plain step, and
taking a batch axis of one off the cache and putting it back copied the cache at every
step. So a generate program of one row holds its cache without a batch axis
(`rows_cache`) and runs the plain function on it (`over_rows`).
"""

import jax
import jax.numpy as jnp

from ..model import KVCache


def _is_cache(x) -> bool:
    return isinstance(x, KVCache)


def rows_cache(single: KVCache, rows: int) -> KVCache:
    """The cache of `rows` rows: `single` itself for one row, else broadcast to a
    leading batch axis."""
    if rows == 1:
        return single
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (rows, *x.shape)), single)


def repeat_rows(cache: KVCache, repeats: int, rows: int) -> KVCache:
    """Each row of `cache` (of `rows` rows) repeated `repeats` times, sample-minor."""
    if rows == 1:
        return rows_cache(cache, repeats)
    return jax.tree.map(lambda x: jnp.repeat(x, repeats, axis=0), cache)


def over_rows(fn, *args, in_axes=0):
    """`jax.vmap(fn, in_axes)(*args)` over the rows of a batch, or, for one row, `fn` on
    that row with the batch axis added back to every output but a cache.

    `in_axes` is `jax.vmap`'s: `0` or `None` per argument. A cache from `rows_cache`
    has no batch axis for one row: it is passed as it is, and returned as it comes.
    """
    axes = (in_axes,) * len(args) if not isinstance(in_axes, tuple) else in_axes
    sizes = {
        leaf.shape[0]
        for arg, axis in zip(args, axes)
        if axis is not None and not _is_cache(arg)
        for leaf in jax.tree.leaves(arg)
    }
    if sizes != {1}:
        return jax.vmap(fn, in_axes=in_axes)(*args)
    take = lambda arg, axis: arg if axis is None or _is_cache(arg) else jax.tree.map(lambda x: x[0], arg)
    out = fn(*map(take, args, axes))
    add = lambda x: x if _is_cache(x) else x[None]
    return jax.tree.map(add, out, is_leaf=_is_cache)
