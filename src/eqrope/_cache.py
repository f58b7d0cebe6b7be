"""The static-shape key/value cache."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ._config import DecoderConfig


class KVCache(eqx.Module):
    """Keys (already rotated) and values of every block, one row per position.

    The layout is heads-major, `(blocks, kv_heads, max_len, head_dim)`, so a chunk of rows
    of one head is contiguous and attention reads it without a transpose.

    The shape is fixed at `max_len` rows, so code that takes a cache compiles once. Row
    `t` holds position `t`; a step at position `pos` attends to rows `0 .. pos - 1` plus
    itself and masks every other row, so rows past the current position may hold anything
    (zeros, or stale rows of a padded prompt) without changing a result.

    It is immutable: `model.prefill` and `model.step` return a new cache. Under `jit`
    (and in the `scan` of `eqrope.generate`) XLA updates the buffer in place. A batch of
    caches has a leading `batch` axis on both arrays (`model.init_cache(batch=...)`), and
    is used with `jax.vmap`.
    """

    keys: Float[Array, "*batch blocks kv_heads max_len head_dim"]
    values: Float[Array, "*batch blocks kv_heads max_len head_dim"]

    @property
    def max_len(self) -> int:
        return self.keys.shape[-2]

    @property
    def nbytes(self) -> int:
        """Bytes held by the two arrays."""
        return int(self.keys.nbytes + self.values.nbytes)

    def block(self, index: Int[Array, ""]) -> "BlockCache":
        """A read-only view of one block's rows (for one sequence, no batch axis)."""
        return BlockCache(keys=self.keys, values=self.values, index=index)


class BlockCache(eqx.Module):
    """One block's cached rows, read in place.

    It holds the whole stacked cache and the block index, and slices only the rows asked
    for. Slicing the block out first (as a `scan` over the blocks axis would) makes XLA
    copy the block's whole `max_len` rows at every step.
    """

    keys: Float[Array, "blocks kv_heads max_len head_dim"]
    values: Float[Array, "blocks kv_heads max_len head_dim"]
    index: Int[Array, ""]

    @property
    def max_len(self) -> int:
        return self.keys.shape[-2]

    def rows(
        self, start: Int[Array, ""] | int, size: int
    ) -> tuple[Float[Array, "kv_heads size head_dim"], Float[Array, "kv_heads size head_dim"]]:
        """Keys and values of rows `start .. start + size - 1` (`start` is not clamped by
        the caller's contract: `start + size <= max_len`)."""
        _, kv_heads, _, head_dim = self.keys.shape
        zero = jnp.zeros((), jnp.int32)
        index = (jnp.asarray(self.index, jnp.int32), zero, jnp.asarray(start, jnp.int32), zero)
        shape = (1, kv_heads, size, head_dim)
        take = lambda x: jax.lax.dynamic_slice(x, index, shape)[0]
        return take(self.keys), take(self.values)


def cache_shape(config: DecoderConfig) -> tuple[int, int, int, int]:
    """`(blocks, kv_heads, max_len, head_dim)` for one sequence."""
    return (config.n_blocks, config.n_kv_heads, config.max_len, config.head_dim)


def cache_nbytes(model_or_config, *, batch: int = 1, positions: int | None = None) -> int:
    """Bytes of a cache, from the closed form

    `2 (keys and values) * batch * blocks * rows * kv_heads * head_dim * itemsize`,

    where `rows` is `max_len` for eqrope's static cache, or `positions` for a cache that
    held only the positions seen so far (the chapter's exercise 3 asks this for 512).
    """
    config = getattr(model_or_config, "config", model_or_config)
    if not isinstance(config, DecoderConfig):
        raise TypeError("cache_nbytes takes a RotaryDecoder or a DecoderConfig.")
    rows = config.max_len if positions is None else positions
    itemsize = jnp.dtype(config.dtype).itemsize
    return 2 * batch * config.n_blocks * rows * config.n_kv_heads * config.head_dim * itemsize
