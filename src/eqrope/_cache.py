"""The static-shape key/value cache."""

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float

from ._config import DecoderConfig


class KVCache(eqx.Module):
    """Keys (already rotated) and values of every block, one row per position.

    The shape is fixed at `max_len` rows, so code that takes a cache compiles once. Row
    `t` holds position `t`; a step at position `pos` attends to rows `0 .. pos - 1` plus
    itself and masks every other row, so rows past the current position may hold anything
    (zeros, or stale rows of a padded prompt) without changing a result.

    It is immutable: `model.prefill` and `model.step` return a new cache. Under `jit`
    (and in the `scan` of `eqrope.generate`) XLA updates the buffer in place. A batch of
    caches has a leading `batch` axis on both arrays (`model.init_cache(batch=...)`), and
    is used with `jax.vmap`.
    """

    keys: Float[Array, "*batch blocks max_len kv_heads head_dim"]
    values: Float[Array, "*batch blocks max_len kv_heads head_dim"]

    @property
    def max_len(self) -> int:
        return self.keys.shape[-3]

    @property
    def nbytes(self) -> int:
        """Bytes held by the two arrays."""
        return int(self.keys.nbytes + self.values.nbytes)


def cache_shape(config: DecoderConfig) -> tuple[int, int, int, int]:
    """`(blocks, max_len, kv_heads, head_dim)` for one sequence."""
    return (config.n_blocks, config.max_len, config.n_kv_heads, config.head_dim)


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
