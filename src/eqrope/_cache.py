"""The static-shape key/value cache, in the model's dtype or in int8 with per-row scales."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Int8

from ._config import DecoderConfig


Rows = Float[Array, "*batch blocks kv_heads max_len head_dim"]
QuantRows = Int8[Array, "*batch blocks kv_heads max_len head_dim"]
Scales = Float[Array, "*batch blocks kv_heads max_len"]


class KVCache(eqx.Module):
    """Keys (already rotated) and values of every block, one row per position.

    The layout is heads-major, `(blocks, kv_heads, max_len, head_dim)`, so a chunk of rows
    of one head is contiguous and attention reads it without a transpose.

    The shape is fixed at `max_len` rows, so code that takes a cache compiles once. Row
    `t` holds position `t`; a step at position `pos` attends to rows `0 .. pos - 1` plus
    itself and masks every other row, so rows past the current position may hold anything
    (zeros, or stale rows of a padded prompt) without changing a result.

    An int8 cache (`model.init_cache(dtype="int8")`) stores each row of `head_dim` values as
    `round(x / s)` with `s = max|x| / 127` kept in float32 beside it (`key_scales`,
    `value_scales`), about a quarter of the float32 bytes; rows are dequantised as they
    are read. The float caches have `None` scales.

    It is immutable: `model.prefill` and `model.step` return a new cache. Under `jit`
    (and in the `scan` of `eqrope.generate`) XLA updates the buffer in place. A batch of
    caches has a leading `batch` axis on every array (`model.init_cache(batch=...)`), and
    is used with `jax.vmap`.
    """

    keys: Rows | QuantRows
    values: Rows | QuantRows
    key_scales: Scales | None = None
    value_scales: Scales | None = None

    @property
    def max_len(self) -> int:
        return self.keys.shape[-2]

    @property
    def quantized(self) -> bool:
        return self.key_scales is not None

    @property
    def nbytes(self) -> int:
        """Bytes held by the arrays (scales included)."""
        arrays = (self.keys, self.values, self.key_scales, self.value_scales)
        return int(sum(a.nbytes for a in arrays if a is not None))

    def block(self, index: Int[Array, ""]) -> "BlockCache":
        """A read-only view of one block's rows (for one sequence, no batch axis)."""
        return BlockCache(self.keys, self.values, self.key_scales, self.value_scales, index)


class BlockCache(eqx.Module):
    """One block's cached rows, read in place.

    It holds the whole stacked cache and the block index, and slices only the rows asked
    for. Slicing the block out first (as a `scan` over the blocks axis would) makes XLA
    copy the block's whole `max_len` rows at every step.
    """

    keys: Float[Array, "blocks kv_heads max_len head_dim"] | Int8[Array, "blocks kv_heads max_len head_dim"]
    values: Float[Array, "blocks kv_heads max_len head_dim"] | Int8[Array, "blocks kv_heads max_len head_dim"]
    key_scales: Float[Array, "blocks kv_heads max_len"] | None
    value_scales: Float[Array, "blocks kv_heads max_len"] | None
    index: Int[Array, ""]

    @property
    def max_len(self) -> int:
        return self.keys.shape[-2]

    def rows(
        self, start: Int[Array, ""] | int, size: int
    ) -> tuple[Float[Array, "kv_heads size head_dim"], Float[Array, "kv_heads size head_dim"]]:
        """Keys and values of rows `start .. start + size - 1` (`start + size <= max_len`),
        dequantised to float32 for an int8 cache."""
        _, kv_heads, _, head_dim = self.keys.shape
        zero = jnp.zeros((), jnp.int32)
        block, start = jnp.asarray(self.index, jnp.int32), jnp.asarray(start, jnp.int32)

        def take(x, scales):
            x = jax.lax.dynamic_slice(x, (block, zero, start, zero), (1, kv_heads, size, head_dim))[0]
            if scales is None:
                return x
            s = jax.lax.dynamic_slice(scales, (block, zero, start), (1, kv_heads, size))[0]
            return x.astype(jnp.float32) * s[..., None]

        return take(self.keys, self.key_scales), take(self.values, self.value_scales)


def quantize_rows(
    rows: Float[Array, "*shape head_dim"],
) -> tuple[Int8[Array, "*shape head_dim"], Float[Array, "*shape"]]:
    """Symmetric int8 per row: `q = round(x / s)`, `s = max|x| / 127` (1 for a zero row)."""
    x = rows.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1) / 127.0
    scale = jnp.where(scale > 0, scale, 1.0)
    q = jnp.clip(jnp.round(x / scale[..., None]), -127, 127).astype(jnp.int8)
    return q, scale


def cache_shape(config: DecoderConfig) -> tuple[int, int, int, int]:
    """`(blocks, kv_heads, max_len, head_dim)` for one sequence."""
    return (config.n_blocks, config.n_kv_heads, config.max_len, config.head_dim)


def empty_cache(config: DecoderConfig, batch: int | None = None, dtype=None) -> KVCache:
    """Zeros of `cache_shape(config)`; `dtype="int8"` adds float32 per-row scales."""
    shape = cache_shape(config) if batch is None else (batch, *cache_shape(config))
    # Separate buffers for each field, so that the cache can be donated.
    if dtype is None or jnp.dtype(dtype) == config.jnp_dtype:
        zeros = lambda: jnp.zeros(shape, config.jnp_dtype)
        return KVCache(keys=zeros(), values=zeros())
    if jnp.dtype(dtype) == jnp.int8:
        q = lambda: jnp.zeros(shape, jnp.int8)
        s = lambda: jnp.ones(shape[:-1], jnp.float32)
        return KVCache(keys=q(), values=q(), key_scales=s(), value_scales=s())
    raise ValueError(
        f"cache dtype must be None (the model's {config.dtype}) or 'int8', got {dtype!r}."
    )


def cache_nbytes(
    model_or_config, *, batch: int = 1, positions: int | None = None, dtype=None
) -> int:
    """Bytes of a cache, from the closed form

    `2 (keys and values) * batch * blocks * rows * kv_heads * head_dim * itemsize`,

    where `rows` is `max_len` for eqrope's static cache, or `positions` for a cache that
    held only the positions seen so far (the chapter's exercise 3 asks this for 512). For
    `dtype="int8"` the itemsize is 1 and each row adds a float32 scale:
    `2 * batch * blocks * rows * kv_heads * (head_dim + 4)`.
    """
    config = getattr(model_or_config, "config", model_or_config)
    if not isinstance(config, DecoderConfig):
        raise TypeError("cache_nbytes takes a RotaryDecoder or a DecoderConfig.")
    rows = config.max_len if positions is None else positions
    per_row = config.head_dim * jnp.dtype(config.dtype).itemsize
    if dtype is not None and jnp.dtype(dtype) == jnp.int8:
        per_row = config.head_dim + 4
    return 2 * batch * config.n_blocks * rows * config.n_kv_heads * per_row
