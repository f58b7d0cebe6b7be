"""The static-shape key/value cache: its layout, writing, checking, quantizing and reading.

Everything a reader needs to know about the cache is here, but for the read: attention
sees one block's rows through a `BlockCache` view (`_block_cache.py`, from `KVCache.block`)
and nothing else.
"""

import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, Int8

from .._checks import check_int, is_concrete
from .._custom_types import IntLike
from ._block_cache import BlockCache, _first
from ._config import DecoderConfig


Rows = Float[Array, "*batch blocks kv_heads max_len head_dim"]
QuantRows = Int8[Array, "*batch blocks kv_heads max_len head_dim"]
Scales = Float[Array, "*batch blocks kv_heads max_len"]
# One block's own buffers (a per-block cache).
BlockRows = Float[Array, "*batch kv_heads max_len head_dim"]
QuantBlockRows = Int8[Array, "*batch kv_heads max_len head_dim"]
BlockScales = Float[Array, "*batch kv_heads max_len"]
# New rows of every block, as attention returns them (heads-major, like the cache).
NewRows = Float[Array, "blocks kv_heads seq head_dim"]

DEFAULT_CHUNK = 256


class KVCache(eqx.Module):
    """Keys (already rotated) and values of every block, one row per position.

    The layout is heads-major, `(blocks, kv_heads, max_len, head_dim)`, end to end:
    attention produces new rows in it, [`write`][eqrope.KVCache.write] stores them and
    [`block`][eqrope.KVCache.block] reads them, with no transpose anywhere.

    The shape is fixed at `max_len` rows, so code that takes a cache compiles once. Row
    `t` holds position `t`; a step at position `pos` attends to rows `0 .. pos - 1` plus
    itself and masks every other row, so rows past the current position may hold anything
    (zeros, or stale rows of a padded prompt) without changing a result.

    An int8 cache (`model.init_cache(dtype="int8")`) stores each row of `head_dim` values as
    `round(x / s)` with `s = max|x| / 127` kept in float32 beside it (`key_scales`,
    `value_scales`), about a quarter of the float32 bytes; rows are dequantised as they
    are read. The float caches have `None` scales.

    Attention reads the rows in chunks of `chunk` rows (a static field, default 256) and
    skips chunks past the position; see [`block`][eqrope.KVCache.block].

    `filled` counts the rows written so far (rows `0 .. filled - 1`; every write at `pos`
    raises it to at least `pos + seq`). `model.prefill` and `model.step` refuse a position
    past it, eagerly and under `jit`, since the rows in between would be attended as if
    they held tokens. Writing below it (rewinding, or re-prefilling) is allowed. A cache
    built by hand without `filled` is not checked.

    **Per-block buffers.** `model.init_cache()` of an unstacked model
    ([`eqrope.RotaryDecoder.unstacked`][]) holds each block's rows in its own buffers:
    `keys`, `values` (and the scales) are then tuples of `n_blocks` arrays
    `(kv_heads, max_len, head_dim)`, so a step writes and reads each block's rows in
    place. The stacked layout has one array with a leading `blocks` axis.

    It is immutable: `model.prefill` and `model.step` return a new cache. Under `jit`
    (and in the loop of `eqrope.generate`) XLA updates the buffer in place. A batch of
    caches has a leading `batch` axis on every array (`model.init_cache(batch=...)`), and
    is used with `jax.vmap`.
    """

    keys: Rows | QuantRows | tuple[BlockRows | QuantBlockRows, ...]
    values: Rows | QuantRows | tuple[BlockRows | QuantBlockRows, ...]
    key_scales: Scales | tuple[BlockScales, ...] | None = None
    value_scales: Scales | tuple[BlockScales, ...] | None = None
    filled: Int[Array, "*batch"] | None = None
    chunk: int = eqx.field(static=True, default=DEFAULT_CHUNK)

    @classmethod
    def empty(
        cls,
        config: DecoderConfig,
        *,
        batch: IntLike | None = None,
        max_len: IntLike | None = None,
        dtype=None,
        chunk: IntLike = DEFAULT_CHUNK,
        per_block: bool = False,
    ) -> "KVCache":
        """Zeros for `config`, with a leading `batch` axis if given.

        `max_len` rows (at most `config.max_len`; `None` means `config.max_len`).
        `dtype=None` stores rows in the model's dtype (exact); `dtype="int8"` stores int8
        rows with float32 per-row scales. `per_block=True` gives each block its own
        buffers (tuples of arrays without the `blocks` axis).
        """
        batch = check_int(batch, "batch", minimum=1, none=True)
        chunk = check_int(chunk, "chunk", minimum=1)
        rows = check_rows(max_len, config)
        shape = _shape(config, rows) if batch is None else (batch, *_shape(config, rows))
        # Separate buffers for each field, so that the cache can be donated.
        filled = jnp.zeros(shape[:-4], jnp.int32)
        if per_block:  # one buffer per block: drop the `blocks` axis
            shape = shape[:-4] + shape[-3:]

        def make(fill, shape, dtype):
            if per_block:
                return tuple(jnp.full(shape, fill, dtype) for _ in range(config.n_blocks))
            return jnp.full(shape, fill, dtype)

        if dtype is None or jnp.dtype(dtype) == config.jnp_dtype:
            zeros = lambda: make(0, shape, config.jnp_dtype)
            return cls(keys=zeros(), values=zeros(), filled=filled, chunk=chunk)
        if jnp.dtype(dtype) == jnp.int8:
            q = lambda: make(0, shape, jnp.int8)
            s = lambda: make(1, shape[:-1], jnp.float32)
            return cls(q(), q(), key_scales=s(), value_scales=s(), filled=filled, chunk=chunk)
        raise ValueError(
            f"cache dtype must be None (the model's {config.dtype}) or 'int8', got {dtype!r}."
        )

    @property
    def per_block(self) -> bool:
        """Whether each block has its own buffers (tuples of arrays)."""
        return isinstance(self.keys, tuple)

    @property
    def max_len(self) -> int:
        return _first(self.keys).shape[-2]

    @property
    def quantized(self) -> bool:
        return self.key_scales is not None

    @property
    def nbytes(self) -> int:
        """Bytes held by the rows and their scales (not the `filled` counter)."""
        arrays = jax.tree.leaves((self.keys, self.values, self.key_scales, self.value_scales))
        return int(sum(a.nbytes for a in arrays))

    def check(self, config: DecoderConfig) -> None:
        """Raise unless this is an unbatched cache for a model with `config`, of at most
        `config.max_len` rows."""
        first = _first(self.keys)
        rows = first.shape[-2] if first.ndim == (3 if self.per_block else 4) else config.max_len
        expected = _shape(config, rows)
        if self.per_block:
            shapes = {a.shape for a in (*self.keys, *self.values)}
            wrong = len(self.keys) != config.n_blocks or len(self.values) != config.n_blocks
            wrong = wrong or shapes != {expected[1:]}
        else:
            wrong = self.keys.shape != expected or self.values.shape != expected
        if wrong or not 1 <= rows <= config.max_len:
            raise ValueError(
                f"cache has shape {self.keys.shape} but this model needs "
                f"{_shape(config, config.max_len)} (blocks, kv_heads, max_len, head_dim), or "
                f"fewer rows than {config.max_len}; build it with model.init_cache()."
            )
        dtypes = {a.dtype for a in jax.tree.leaves((self.keys, self.values))}
        if self.quantized:
            scales = jax.tree.leaves((self.key_scales, self.value_scales))
            ok = (
                dtypes == {jnp.dtype(jnp.int8)}
                and self.value_scales is not None
                and {s.shape for s in scales} == {expected[1:-1] if self.per_block else expected[:-1]}
            )
        else:
            ok = dtypes == {config.jnp_dtype}
        if not ok:
            raise ValueError(
                f"cache has dtype {self.keys.dtype} but the model uses {config.dtype} "
                "(or an int8 cache with scales); build it with model.init_cache()."
            )

    def split_blocks(self) -> "KVCache":
        """The same rows in per-block buffers (a copy, under `jit` once); a per-block
        cache is returned as it is."""
        if self.per_block:
            return self

        def split(x, trailing: int):  # the blocks axis has `trailing` axes after it
            if x is None:
                return None
            axis = x.ndim - trailing - 1
            return tuple(jnp.take(x, i, axis=axis) for i in range(x.shape[axis]))

        return dataclasses.replace(
            self, keys=split(self.keys, 3), values=split(self.values, 3),
            key_scales=split(self.key_scales, 2), value_scales=split(self.value_scales, 2),
        )  # fmt: skip

    def write_block(
        self,
        index: int,
        keys: Float[Array, "kv_heads seq head_dim"],
        values: Float[Array, "kv_heads seq head_dim"],
        pos: Int[Array, ""],
    ) -> "KVCache":
        """A per-block cache with rows `pos .. pos + seq - 1` of block `index` (a Python
        int) replaced, in that block's own buffers. `filled` is raised by `write` once
        every block is written (`advance`)."""
        zero = np.int32(0)  # a static index: no traced bounds arithmetic (int32 under x64 too)
        pos = jnp.asarray(pos).astype(jnp.int32)

        def put(buffers, rows):  # rows go to axis 1, `max_len`, of the block's buffer
            buffer = buffers[index]
            start = (zero, pos) + (zero,) * (buffer.ndim - 2)
            # `pos >= 0`: no wrapping of negative indices to trace.
            new = jax.lax.dynamic_update_slice(
                buffer, rows.astype(buffer.dtype), start, allow_negative_indices=False
            )
            return buffers[:index] + (new,) + buffers[index + 1 :]

        if not self.quantized:
            return dataclasses.replace(self, keys=put(self.keys, keys), values=put(self.values, values))
        (qk, sk), (qv, sv) = quantize_rows(keys), quantize_rows(values)
        return dataclasses.replace(
            self, keys=put(self.keys, qk), values=put(self.values, qv),
            key_scales=put(self.key_scales, sk), value_scales=put(self.value_scales, sv),
        )  # fmt: skip

    def advance(self, pos: Int[Array, ""], seq: int) -> "KVCache":
        """`filled` raised to at least `pos + seq` (after every block wrote its rows)."""
        if self.filled is None:
            return self
        pos = jnp.asarray(pos).astype(jnp.int32)
        return dataclasses.replace(self, filled=jnp.maximum(self.filled, pos + seq).astype(self.filled.dtype))

    def write(self, keys: NewRows, values: NewRows, pos: Int[Array, ""]) -> "KVCache":
        """A new cache with rows `pos .. pos + seq - 1` of every block replaced (quantised
        first for an int8 cache). The caller has checked that the rows fit."""
        if self.per_block:
            cache = self
            for i in range(len(self.keys)):
                cache = cache.write_block(i, keys[i], values[i], pos)
            return cache.advance(pos, keys.shape[-2])
        zero = np.int32(0)
        pos = jnp.asarray(pos).astype(jnp.int32)

        def put(buffer, rows):  # rows go to axis 2, `max_len`, of every array
            start = (zero, zero, pos) + (zero,) * (buffer.ndim - 3)
            return jax.lax.dynamic_update_slice(
                buffer, rows.astype(buffer.dtype), start, allow_negative_indices=False
            )

        filled = self.filled
        if filled is not None:
            filled = jnp.maximum(filled, pos + keys.shape[-2]).astype(filled.dtype)
        if not self.quantized:
            new = (put(self.keys, keys), put(self.values, values), None, None)
        else:
            (qk, sk), (qv, sv) = quantize_rows(keys), quantize_rows(values)
            new = (put(self.keys, qk), put(self.values, qv), put(self.key_scales, sk), put(self.value_scales, sv))
        return KVCache(*new, filled=filled, chunk=self.chunk)

    def check_position(self, pos, seq: int):
        """`pos`, unless writing `seq` rows there would leave unwritten rows below it (a
        position past `filled`); raises eagerly, or under `jit` through `eqx.error_if`."""
        if self.filled is None:
            return pos
        if is_concrete(pos) and is_concrete(self.filled):
            filled = int(np.asarray(self.filled))
            if int(pos) > filled:
                raise ValueError(
                    f"pos={int(pos)} leaves a gap: the cache holds positions 0..{filled - 1} "
                    f"(filled={filled}), and rows {filled}..{int(pos) - 1} were never written. "
                    f"Step or prefill at pos <= {filled}; positions must be consecutive."
                )
            return pos
        return eqx.error_if(
            pos, pos > self.filled, "pos is past the cache's filled rows (a gap); positions must be consecutive."
        )

    def block(
        self,
        index: int | Int[Array, ""],
        bound: Int[Array, ""] | None = None,
        low: Int[Array, ""] | None = None,
    ) -> "BlockCache":
        """A read-only view of block `index`'s rows (one sequence, no batch axis).

        `bound`: chunks of rows at or past it are not read (default: the position of the
        first query). `low`: with a sliding window, chunks wholly before the window of a
        query at `low` are not read (default: the position of the first query). Under
        `jax.vmap` over rows at different positions, pass unbatched values (the batch's
        furthest and nearest positions), or the skips become selects that read every
        chunk. Neither changes the result.
        """
        if self.per_block:  # the block's own buffers; `index` is a Python int
            pick = lambda x: None if x is None else x[int(index)]
            return BlockCache(
                pick(self.keys), pick(self.values), pick(self.key_scales), pick(self.value_scales),
                None, bound, low, self.chunk,
            )  # fmt: skip
        return BlockCache(
            self.keys, self.values, self.key_scales, self.value_scales, index, bound, low, self.chunk
        )


def quantize_rows(
    rows: Float[Array, "*shape head_dim"],
) -> tuple[Int8[Array, "*shape head_dim"], Float[Array, "*shape"]]:
    """Symmetric int8 per row: `q = round(x / s)`, `s = max|x| / 127` (1 for a zero row)."""
    x = rows.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1) / 127.0
    scale = jnp.where(scale > 0, scale, 1.0)
    q = jnp.clip(jnp.round(x / scale[..., None]), -127, 127).astype(jnp.int8)
    return q, scale


def _shape(config: DecoderConfig, rows: int) -> tuple[int, int, int, int]:
    """`(blocks, kv_heads, rows, head_dim)` for one sequence."""
    return (config.n_blocks, config.n_kv_heads, rows, config.head_dim)


def check_rows(max_len, config: DecoderConfig) -> int:
    """A cache length: `None` means the model's `max_len`; anything else is an int in
    `[1, config.max_len]`."""
    rows = check_int(max_len, "max_len", minimum=1, none=True)
    if rows is None:
        return config.max_len
    if rows > config.max_len:
        raise ValueError(
            f"max_len={rows} cache rows, but the model's max_len is {config.max_len}; "
            "a cache cannot hold positions the model was not built for. Pass at most "
            f"{config.max_len}, or build the model with a larger max_len."
        )
    return rows


def cache_nbytes(
    of, *, batch: IntLike = 1, positions: IntLike | None = None, dtype=None
) -> int:
    """Bytes of a cache, from the closed form

    `2 (keys and values) * batch * blocks * rows * kv_heads * head_dim * itemsize`,

    where `rows` is `max_len` for eqrope's static cache, or `positions` for a cache that
    held only the positions seen so far (the chapter's exercise 3 asks this for 512). For
    `dtype="int8"` the itemsize is 1 and each row adds a float32 scale:
    `2 * batch * blocks * rows * kv_heads * (head_dim + 4)`.

    **Arguments:**

    - `of`: a [`eqrope.RotaryDecoder`][], a [`eqrope.DecoderConfig`][], or a
      [`eqrope.KVCache`][]. For a cache, its own shape and dtype are used (a batched
      cache counts its batch), and `batch` and `dtype` must be left at their defaults.
    - `batch`, `positions`, `dtype`: as above.
    """
    batch = check_int(batch, "cache_nbytes: batch", minimum=1)
    positions = check_int(positions, "cache_nbytes: positions", minimum=0, none=True)
    if isinstance(of, KVCache):
        if batch != 1 or dtype is not None:
            raise ValueError(
                "cache_nbytes(cache) reads the batch and dtype from the cache; "
                "leave batch and dtype at their defaults."
            )
        first = _first(of.keys)
        *lead, max_len, head_dim = first.shape  # lead: (*batch, blocks, kv_heads)
        lead = (*lead, len(of.keys)) if of.per_block else lead
        per_row = head_dim * first.dtype.itemsize + (4 if of.quantized else 0)
        rows = max_len if positions is None else positions
        return 2 * math.prod(lead) * rows * per_row
    config = getattr(of, "config", of)
    if not isinstance(config, DecoderConfig):
        raise TypeError(
            "cache_nbytes takes a RotaryDecoder, a DecoderConfig or a KVCache, "
            f"got {type(of).__name__}."
        )
    rows = config.max_len if positions is None else positions
    per_row = config.head_dim * jnp.dtype(config.dtype).itemsize
    if dtype is not None and jnp.dtype(dtype) == jnp.int8:
        per_row = config.head_dim + 4
    return 2 * batch * config.n_blocks * rows * config.n_kv_heads * per_row
