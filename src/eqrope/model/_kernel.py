"""Attention arithmetic: an online softmax over the cache, chunk by chunk.

A decode step at position `pos` needs only the cache rows below `pos`. The cache has a
static `max_len` rows, so a plain masked softmax reads all of them whatever the position.
Here the rows are visited in chunks of `past.chunk` rows, and chunks at or beyond
`past.bound` are skipped by a `lax.cond` inside a `lax.scan`: the shapes stay static (one compile per
`max_len`), the work follows the position, and the loop stays reverse-differentiable.
Partial results are merged with the streaming softmax of Milakov & Gimelshein (2018), as
in FlashAttention (Dao et al. 2022).

Scores, softmax and the weighted sum of the values compute in `promote_types(dtype,
float32)` (`acc_dtype`): float32 for bfloat16 and float32 models, float64 for a float64
model (under `jax_enable_x64`).
"""

import functools
import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ._cache import BlockCache


# (running max, running sum, running weighted values), all in `acc_dtype`.
State = tuple[
    Float[Array, "kv_heads group seq"],
    Float[Array, "kv_heads group seq"],
    Float[Array, "kv_heads group seq head_dim"],
]


def acc_dtype(dtype) -> jnp.dtype:
    """The dtype attention computes in for inputs of `dtype`: at least float32."""
    with jax.numpy_dtype_promotion("standard"):
        return jnp.promote_types(dtype, jnp.float32)


def empty_state(kv_heads: int, group: int, seq: int, head_dim: int, dtype=jnp.float32) -> State:
    """The state of no rows seen, in `acc_dtype(dtype)`."""
    shape, dtype = (kv_heads, group, seq), acc_dtype(dtype)
    return (
        jnp.full(shape, -jnp.inf, dtype),
        jnp.zeros(shape, dtype),
        jnp.zeros((*shape, head_dim), dtype),
    )


def scores(
    q: Float[Array, "seq kv_heads group head_dim"], k: Float[Array, "kv_heads rows head_dim"]
) -> Float[Array, "kv_heads group seq rows"]:
    """`q . k / sqrt(head_dim)` in `acc_dtype` (float32, or float64 for float64 `q`)."""
    q, k = _common(q, k)
    # `einsum("skgd,ktd->kgst")` as jnp.einsum writes it, without tracing its parser and
    # its nested function (four times a block in a deep model's program).
    s = jax.lax.dot_general(k, q, (((2,), (3,)), ((0,), (1,))), preferred_element_type=acc_dtype(q.dtype))
    return jnp.transpose(s, (0, 3, 2, 1)) * (1.0 / q.shape[-1] ** 0.5)


def _weighted(p: Float[Array, "kv_heads group seq rows"], v: Float[Array, "kv_heads rows head_dim"]):
    """`einsum("kgst,ktd->kgsd", p, v)` in `p`'s dtype, as jnp.einsum writes it."""
    p_v, v = _common(p.astype(v.dtype), v)
    return jax.lax.dot_general(p_v, v, (((3,), (1,)), ((0,), (0,))), preferred_element_type=p.dtype)


def _common(a, b):
    """`a` and `b` in their promoted dtype, as jnp.einsum takes mixed operands (a bfloat16
    query against an int8 cache's float32 keys)."""
    dtype = jnp.promote_types(a.dtype, b.dtype)
    return a.astype(dtype), b.astype(dtype)


def merge(
    state: State,
    q: Float[Array, "seq kv_heads group head_dim"],
    k: Float[Array, "kv_heads rows head_dim"],
    v: Float[Array, "kv_heads rows head_dim"],
    mask: Bool[Array, "#seq rows"],
) -> State:
    """Fold the rows `k, v` (where `mask`) into the running softmax `state`."""
    m, l, acc = state
    s = jnp.where(mask, scores(q, k), -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    # A row with nothing visible yet has m_new = -inf; shift by 0 there to avoid inf - inf.
    shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(s - shift[..., None])
    correction = jnp.exp(m - shift)
    l = l * correction + jnp.sum(p, axis=-1)
    return m_new, l, acc * correction[..., None] + _weighted(p, v)


def attend(
    q: Float[Array, "seq kv_heads group head_dim"],
    k: Float[Array, "kv_heads rows head_dim"],
    v: Float[Array, "kv_heads rows head_dim"],
    mask: Bool[Array, "#seq rows"],
) -> Float[Array, "seq kv_heads group head_dim"]:
    """The softmax-weighted values of the rows `k, v` (where `mask`) in one pass, as a
    plain masked softmax: `merge` into an empty state and `finish`, without the running
    state. Every query must see at least one row."""
    s = jnp.where(mask, scores(q, k), -jnp.inf)
    p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
    return jnp.transpose(_weighted(p, v) / jnp.sum(p, axis=-1)[..., None], (2, 0, 1, 3))


def finish(state: State) -> Float[Array, "seq kv_heads group head_dim"]:
    """The softmax-weighted values, `acc / l`, as `(seq, kv_heads, group, head_dim)`."""
    _, l, acc = state
    return jnp.transpose(acc / l[..., None], (2, 0, 1, 3))


def merge_cache(
    state: State,
    q: Float[Array, "seq kv_heads group head_dim"],
    past: BlockCache,
    positions: Int[Array, " seq"],
    window: Int[Array, ""] | None = None,
    *,
    inclusive: bool = False,
) -> State:
    """Fold the cache rows below `positions[0]` into `state`, in chunks of `past.chunk`
    rows, visiting only chunks below `past.bound` (default `positions[0]`).

    `inclusive=True` is for a cache that already holds the rows of `positions` (written
    first): each query sees the rows up to its own position (causally), and chunks at or
    past `past.bound + seq` are not visited.

    With a sliding `window`, the query at position `p` sees rows `r > p - window` only,
    and chunks wholly below `past.low - window + 1` (default `past.low = positions[0]`)
    are not visited either, so a step reads about `window` rows whatever its position.

    Under `jax.vmap` a batched position would turn the skips into selects that run every
    chunk, so a batched caller gives the view unbatched bounds (the batch's largest and
    smallest positions).
    """
    max_len, chunk = past.max_len, past.chunk
    n_valid = positions[0]
    bound = n_valid if past.bound is None else past.bound
    low = n_valid if past.low is None else past.low
    if inclusive:
        bound = bound + positions.shape[0]
    mask = functools.partial(_visible, positions=positions, window=window, inclusive=inclusive)

    if max_len <= chunk:
        return merge(state, q, *past.rows(0, max_len), mask(jnp.arange(max_len, dtype=jnp.int32), 0))
    n_chunks = math.ceil(max_len / chunk)
    offsets = jnp.arange(chunk, dtype=jnp.int32)

    def body(state, j):
        first = j * chunk
        # The last chunk may overlap the one before it; its repeated rows are masked.
        start = jnp.minimum(first, max_len - chunk)
        needed = first < bound
        if window is not None:
            needed = needed & (first + chunk > low - window + 1)

        def visit(state):
            return merge(state, q, *past.rows(start, chunk), mask(start + offsets, first))

        return jax.lax.cond(needed, visit, lambda s: s, state), None

    state, _ = jax.lax.scan(body, state, jnp.arange(n_chunks, dtype=jnp.int32))
    return state


def attend_cache(
    q: Float[Array, "seq kv_heads group head_dim"],
    past: BlockCache,
    positions: Int[Array, " seq"],
    window: Int[Array, ""] | None = None,
) -> Float[Array, "seq kv_heads group head_dim"]:
    """`finish(merge_cache(empty, q, past, positions, window, inclusive=True))` for a
    cache that fits in one chunk (`past.max_len <= past.chunk`), as one plain masked
    softmax over all its rows, as a minimal decoder attends."""
    rows = jnp.arange(past.max_len, dtype=jnp.int32)
    mask = _visible(rows, 0, positions=positions, window=window, inclusive=True)
    return attend(q, *past.rows(0, past.max_len), mask)


def _visible(rows, first, *, positions, window, inclusive: bool) -> Bool[Array, "#seq rows"]:
    """Which of the cache `rows` (from `first`) each query at `positions` sees: rows
    before `positions[0]`, or with `inclusive` (the new rows written first) each query's
    rows up to its own position; with a sliding `window`, only rows `r > p - window`."""
    if inclusive:
        visible = (rows[None, :] >= first) & (rows[None, :] <= positions[:, None])
    else:
        visible = ((rows >= first) & (rows < positions[0]))[None, :]
    if window is None:
        return visible
    return visible & (rows[None, :] > positions[:, None] - window)
