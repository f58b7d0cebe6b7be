"""`BlockCache`: one block's view of the key/value cache, read in place, chunk by chunk.

`KVCache.block` builds it over contiguous rows; the engine (`eqrope.serving`) builds it
over a pool of pages with a page table, and then each chunk of rows is found through the
table. Attention reads the rows it needs through `rows` and nothing else, so it walks
either cache the same way.
"""

import functools
from typing import Protocol, runtime_checkable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, Int8


class BlockCache(eqx.Module):
    """One block's cached rows, read in place, in chunks of `chunk` rows from `low`'s
    window up to `bound`.

    It holds the whole stacked cache and the block index (or, for a per-block cache, the
    block's own buffers and no index), and slices only the rows asked for. Slicing the block out first (as a `scan` over the blocks axis would) makes XLA
    copy the block's whole `max_len` rows at every step.

    Paged: with a `table`, `keys` and `values` are one block's pool of pages, `(kv_heads,
    pages, page_size, head_dim)` (the layout JAX's Pallas paged-attention kernels take),
    and row `r` of the sequence is row `r % page_size` of page `table[r // page_size]`;
    `max_len` is `max_pages * page_size`. Reads start and end on page boundaries.
    """

    keys: (
        Float[Array, "*blocks kv_heads max_len head_dim"]
        | Int8[Array, "*blocks kv_heads max_len head_dim"]
        | Float[Array, "kv_heads pages page_size head_dim"]
    )
    values: (
        Float[Array, "*blocks kv_heads max_len head_dim"]
        | Int8[Array, "*blocks kv_heads max_len head_dim"]
        | Float[Array, "kv_heads pages page_size head_dim"]
    )
    key_scales: Float[Array, "*blocks kv_heads max_len"] | None
    value_scales: Float[Array, "*blocks kv_heads max_len"] | None
    index: Int[Array, ""] | None
    bound: Int[Array, ""] | None
    low: Int[Array, ""] | None
    chunk: int = eqx.field(static=True)
    table: Int[Array, " max_pages"] | None = None

    @property
    def max_len(self) -> int:
        if self.table is not None:
            return self.table.shape[0] * self.keys.shape[-2]
        return _first(self.keys).shape[-2]

    def rows(
        self, start: Int[Array, ""] | int, size: int
    ) -> tuple[Float[Array, "kv_heads size head_dim"], Float[Array, "kv_heads size head_dim"]]:
        """Keys and values of rows `start .. start + size - 1` (`start + size <= max_len`),
        dequantised to float32 for an int8 cache."""
        if self.table is not None:
            return self._paged_rows(start, size)
        kv_heads, _, head_dim = self.keys.shape[-3:]
        zero = np.int32(0)  # static indices, and `start >= 0`: no traced bounds arithmetic
        start = jnp.asarray(start, jnp.int32)
        at = functools.partial(jax.lax.dynamic_slice, allow_negative_indices=False)

        def take(x, scales):
            if self.index is None:  # a per-block buffer, read in place
                x = at(x, (zero, start, zero), (kv_heads, size, head_dim))
                s = None if scales is None else at(scales, (zero, start), (kv_heads, size))
            else:
                block = jnp.asarray(self.index, jnp.int32)
                x = at(x, (block, zero, start, zero), (1, kv_heads, size, head_dim))[0]
                s = None if scales is None else at(scales, (block, zero, start), (1, kv_heads, size))[0]
            if s is None:
                return x
            return x.astype(jnp.float32) * s[..., None]

        return take(self.keys, self.key_scales), take(self.values, self.value_scales)

    def _paged_rows(self, start, size: int):
        """`rows` through the page table: the pages holding rows `start .. start + size - 1`
        (`start` and `size` multiples of the page size), gathered in order."""
        kv_heads, _, page_size, head_dim = self.keys.shape
        if size % page_size:
            raise ValueError(f"a paged read of {size} rows is not whole pages of {page_size}.")
        first = jnp.asarray(start, jnp.int32) // page_size
        n = size // page_size
        pages = jax.lax.dynamic_slice(self.table, (first,), (n,))
        take = lambda pool: pool[:, pages].reshape(kv_heads, size, head_dim)
        return take(self.keys), take(self.values)


def _first(x):
    """A per-block field's first block, or the stacked array itself."""
    return x[0] if isinstance(x, tuple) else x


@runtime_checkable
class CacheView(Protocol):
    """What the blocks read of a cache: one `BlockCache` per block. [`eqrope.KVCache`][]
    is one; the engine's paged view (`eqrope.serving._paged_cache.PagedView`) another.
    `per_block`: whether `block` takes a block's Python int index (each block's own
    buffers) rather than a traced one."""

    per_block: bool

    def block(self, index, bound=None, low=None) -> BlockCache: ...
