"""`BlockCache`: one block's view of the key/value cache, read in place, chunk by chunk.

`KVCache.block` builds it; attention reads the rows it needs through `rows` and nothing else.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Int8


class BlockCache(eqx.Module):
    """One block's cached rows, read in place, in chunks of `chunk` rows from `low`'s
    window up to `bound`.

    It holds the whole stacked cache and the block index (or, for a per-block cache, the
    block's own buffers and no index), and slices only the rows asked for. Slicing the block out first (as a `scan` over the blocks axis would) makes XLA
    copy the block's whole `max_len` rows at every step.
    """

    keys: Float[Array, "*blocks kv_heads max_len head_dim"] | Int8[Array, "*blocks kv_heads max_len head_dim"]
    values: Float[Array, "*blocks kv_heads max_len head_dim"] | Int8[Array, "*blocks kv_heads max_len head_dim"]
    key_scales: Float[Array, "*blocks kv_heads max_len"] | None
    value_scales: Float[Array, "*blocks kv_heads max_len"] | None
    index: Int[Array, ""] | None
    bound: Int[Array, ""] | None
    low: Int[Array, ""] | None
    chunk: int = eqx.field(static=True)

    @property
    def max_len(self) -> int:
        return _first(self.keys).shape[-2]

    def rows(
        self, start: Int[Array, ""] | int, size: int
    ) -> tuple[Float[Array, "kv_heads size head_dim"], Float[Array, "kv_heads size head_dim"]]:
        """Keys and values of rows `start .. start + size - 1` (`start + size <= max_len`),
        dequantised to float32 for an int8 cache."""
        kv_heads, _, head_dim = self.keys.shape[-3:]
        zero = jnp.zeros((), jnp.int32)
        start = jnp.asarray(start, jnp.int32)

        def take(x, scales):
            if self.index is None:  # a per-block buffer, read in place
                x = jax.lax.dynamic_slice(x, (zero, start, zero), (kv_heads, size, head_dim))
                s = None if scales is None else jax.lax.dynamic_slice(scales, (zero, start), (kv_heads, size))
            else:
                block = jnp.asarray(self.index, jnp.int32)
                x = jax.lax.dynamic_slice(x, (block, zero, start, zero), (1, kv_heads, size, head_dim))[0]
                s = None if scales is None else jax.lax.dynamic_slice(scales, (block, zero, start), (1, kv_heads, size))[0]
            if s is None:
                return x
            return x.astype(jnp.float32) * s[..., None]

        return take(self.keys, self.key_scales), take(self.values, self.value_scales)


def _first(x):
    """A per-block field's first block, or the stacked array itself."""
    return x[0] if isinstance(x, tuple) else x
