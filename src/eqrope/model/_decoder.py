"""The rotary decoder: embedding, a stack of pre-norm blocks, final norm, linear head."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray

from ._block import DecoderBlock
from ._block_cache import CacheView
from ._cache import DEFAULT_CHUNK, KVCache, NewRows
from .._checks import as_int_array, check_span, check_vocab, is_concrete, on_device
from .._custom_types import IntLike
from ._config import SIZES, DecoderConfig
from ._init import uniform_weight
from ._layouts import check_layout, decode_in_place, scan_blocks, unroll_blocks
from ._matmul import converted_in_step, matmul_vocab
from ._norm import make_norm, norm_rows


_OPTIONS = tuple(f.name for f in dataclasses.fields(DecoderConfig) if f.name not in SIZES)
def _rows_of(table: Float[Array, "rows d_model"], index: Int[Array, " seq"]) -> Float[Array, "seq d_model"]:
    """`table[index]`. XLA:CPU gathers a low-precision table in float32 and would convert
    the whole table once, before any loop, and hold it (see `_matmul.py`); behind an
    optimization barrier with `index` the conversion stays in the step, fused with the
    gather, and converts only the rows taken."""
    if converted_in_step(table):
        _, table = jax.lax.optimization_barrier((index, table))
    return table[index]


class RotaryDecoder(eqx.Module):
    """A decoder-only transformer with rotary positions and a static key/value cache.

    `model(ids)` runs one sequence; batch with `jax.vmap(model)`. The blocks have two
    layouts, which give the same logits:

    - **stacked** (the default, for training): one [`eqrope.DecoderBlock`][] whose arrays
      have a leading `blocks` axis, run with `jax.lax.scan`, so compile time does not grow
      with depth;
    - **unstacked** (for decoding; [`unstacked`][eqrope.RotaryDecoder.unstacked]): a
      tuple of blocks, each with its own arrays, run by a Python `for` inside the
      compiled program. XLA on the CPU copies each block's slice of a stacked array
      before a matrix product; separate buffers are read in place.

    The cache protocol, used by [`eqrope.generate`][]:

    - `cache = model.init_cache()`;
    - `logits, cache = model.prefill(ids, cache, pos)`: many tokens in one pass;
    - `logits, cache = model.step(token, cache, pos)`: one token.

    **Fields:** `embed (vocab, d_model)`; `pos_embed (max_len, d_model)` or `None`;
    `blocks` (stacked [`eqrope.DecoderBlock`][]); `final_norm`; `head (d_model, vocab)`, or
    `None` when tied to `embed`; `head_bias (vocab,)` or `None`; `config` (static).
    """

    embed: Float[Array, "vocab d_model"]
    pos_embed: Float[Array, "max_len d_model"] | None
    blocks: DecoderBlock | tuple[DecoderBlock, ...]
    final_norm: eqx.nn.RMSNorm | eqx.nn.LayerNorm
    head: Float[Array, "d_model vocab"] | None
    head_bias: Float[Array, " vocab"] | None
    config: DecoderConfig = eqx.field(static=True)

    def __init__(
        self,
        vocab_size: IntLike,
        d_model: IntLike,
        n_heads: IntLike,
        n_blocks: IntLike,
        max_len: IntLike,
        *,
        key: PRNGKeyArray,
        **options,
    ):
        """**Arguments:** the five sizes in the seed's order, `key`, and any keyword
        options, which are the other fields of [`eqrope.DecoderConfig`][] (`d_ff`,
        `n_kv_heads`, `attention`, `rope_base`, `rope_scaling`, `positions`, `norm`, `norm_eps`, `mlp`,
        `bias`, `head_bias`, `tie_embeddings`, `remat`, `dtype`), with the same defaults.
        `dtype=None` means float32 (also under `jax_enable_x64`).
        """
        unknown = sorted(set(options) - set(_OPTIONS))
        if unknown:
            raise TypeError(
                f"RotaryDecoder got unknown options {unknown}; the options are the fields of "
                f"DecoderConfig: {', '.join(_OPTIONS)}."
            )
        config = DecoderConfig(vocab_size, d_model, n_heads, n_blocks, max_len, **options)
        vocab_size, d_model, n_blocks, max_len = config.vocab_size, config.d_model, config.n_blocks, config.max_len
        embed_key, pos_key, blocks_key, head_key = jax.random.split(key, 4)
        dt = config.jnp_dtype
        self.config = config
        self.embed = jax.random.normal(embed_key, (vocab_size, d_model), jnp.float32).astype(dt)
        if config.positions == "learned":
            self.pos_embed = jax.random.normal(pos_key, (max_len, d_model), jnp.float32).astype(dt)
        else:
            self.pos_embed = None
        block_keys = jax.random.split(blocks_key, n_blocks)
        self.blocks = eqx.filter_vmap(lambda k: DecoderBlock(config, key=k))(block_keys)
        self.final_norm = make_norm(config.norm, d_model, config.norm_eps, dt)
        if config.tie_embeddings:
            self.head = None
        else:
            self.head = uniform_weight(head_key, d_model, (d_model, vocab_size), dt)
        self.head_bias = jnp.zeros((vocab_size,), dt) if config.head_bias else None

    @classmethod
    def from_config(cls, config: DecoderConfig, *, key: PRNGKeyArray) -> "RotaryDecoder":
        """Build a decoder from a [`eqrope.DecoderConfig`][]."""
        sizes = (getattr(config, name) for name in SIZES)
        return cls(*sizes, key=key, **config.options())

    # -- the two layouts -----------------------------------------------------------------

    @property
    def layout(self) -> str:
        """`"stacked"` or `"unstacked"` (see the class docstring)."""
        return "unstacked" if isinstance(self.blocks, tuple) else "stacked"

    def unstacked(self) -> "RotaryDecoder":
        """The same model with one [`eqrope.DecoderBlock`][] per block, each holding its
        own arrays (copied out of the stack once, here): the layout for generation.
        Returns `self` when it is already unstacked."""
        if self.layout == "unstacked":
            return self
        take = lambda i: jax.tree.map(lambda x: x[i] if eqx.is_array(x) else x, self.blocks)
        blocks = tuple(take(i) for i in range(self.config.n_blocks))
        return eqx.tree_at(lambda m: m.blocks, self, blocks)

    def with_layout(self, layout: str) -> "RotaryDecoder":
        """`self.stacked()` for `"stacked"`, `self.unstacked()` for `"unstacked"`."""
        check_layout(layout, "layout")
        return self.stacked() if layout == "stacked" else self.unstacked()

    def stacked(self) -> "RotaryDecoder":
        """The same model with its blocks stacked on a leading axis: the layout for
        training (a `jax.lax.scan` over blocks). Returns `self` when already stacked."""
        if self.layout == "stacked":
            return self
        stack = lambda *xs: jnp.stack(xs) if eqx.is_array(xs[0]) else xs[0]
        return eqx.tree_at(lambda m: m.blocks, self, jax.tree.map(stack, *self.blocks))

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def max_len(self) -> int:
        return self.config.max_len

    def __getattr__(self, name: str):
        # Reached only when the ordinary lookup fails: `model.generate(ids, 5)`, as in transformers.
        if name in ("generate", "generate_text"):
            raise AttributeError(
                f"RotaryDecoder has no method {name!r}: eqrope's generation is a function that "
                "takes the model. Call eqrope.generate(model, ids, 5) with token ids, or "
                "eqrope.generate_text(model, tokenizer, 'Some text', 5) with text.",
                name=name, obj=self,
            )  # fmt: skip
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}", name=name, obj=self)

    @property
    def fixed_rows(self) -> int | None:
        """The number of rows the model runs on (under `jax.vmap` over exactly that many),
        or `None` for any number. A module that stands where a weight array is and has its
        own `fixed_rows` sets it: an adapter chosen per row ([`eqrope.select_adapters`][])
        fixes the batch. `generate` refuses a prompt of another shape before it compiles."""
        stands_in = lambda x: isinstance(x, eqx.Module) and hasattr(type(x), "fixed_rows")  # noqa: E731
        rows = (x.fixed_rows for x in jax.tree.leaves(self.blocks, is_leaf=stands_in) if stands_in(x))
        return next((r for r in rows if r is not None), None)

    # -- the forward pass ----------------------------------------------------------------

    def __call__(self, ids: Int[ArrayLike, " seq"]) -> Float[Array, "seq vocab"]:
        """Logits for every position of one sequence, `1 <= seq <= max_len`.

        Token ids outside `[0, vocab_size)` raise, also under `jit` (`eqx.error_if`).
        """
        ids = self._check_ids(ids, "ids")
        positions = jnp.arange(ids.shape[0], dtype=jnp.int32)
        logits, _, _ = self.forward(ids, positions)
        return logits

    def forward(
        self,
        ids: Int[Array, " seq"],
        positions: Int[Array, " seq"],
        cache: CacheView | None = None,
        *,
        kv_bound: Int[Array, ""] | None = None,
        kv_low: Int[Array, ""] | None = None,
        logits_at: Int[Array, " rows"] | None = None,
    ) -> tuple[Float[Array, "rows vocab"], NewRows, NewRows]:
        """The unchecked core: logits and each block's new keys and values.

        `logits_at` picks the rows whose logits are computed (default: every row): a
        prefill that needs only its last position's logits skips the head's product for
        the others, the largest product of a model with a large vocabulary.

        `positions` must be consecutive; the cache rows `r < positions[0]` are attended,
        and chunks of cache rows at or past `kv_bound` (default `positions[0]`), or, with a
        sliding window, wholly before the window of position `kv_low` (default
        `positions[0]`), are not read (see [`eqrope.KVCache.block`][]). Public callers
        want `__call__`, `prefill` or `step`, which check their inputs.
        """
        x = self._embed(ids, positions)
        run = unroll_blocks if isinstance(self.blocks, tuple) else scan_blocks
        x, keys, values = run(self.blocks, self.config, x, positions, cache, kv_bound, kv_low)
        if logits_at is not None:
            x = x[logits_at]
        return self._logits(x), keys, values

    def _embed(self, ids, positions):
        x = _rows_of(self.embed, ids)
        if self.pos_embed is not None:
            x = x + _rows_of(self.pos_embed, positions)
        return x

    def _logits(self, x):
        x = norm_rows(self.final_norm, x)
        if self.head is None:
            # Contract with the embedding's rows as they lie: `x @ embed.T` would make XLA
            # copy the transposed (vocab, d_model) table, on every step or held in memory.
            logits = matmul_vocab(x, self.embed, rows=True)
        else:
            logits = matmul_vocab(x, self.head, rows=False)
        if self.head_bias is not None:
            logits = logits + self.head_bias
        return logits

    # -- the cache protocol --------------------------------------------------------------

    def init_cache(
        self,
        batch: IntLike | None = None,
        *,
        max_len: IntLike | None = None,
        dtype=None,
        chunk: IntLike = DEFAULT_CHUNK,
    ) -> KVCache:
        """An empty cache (with a leading `batch` axis if given).

        **Arguments:**

        - `batch`: rows of a batched cache, for use with `jax.vmap`; `None` for one
          sequence.
        - `max_len`: the cache rows, that is the most positions it holds, at most the
          model's `max_len`; `None` means the model's. RoPE needs no table, so a shorter
          cache changes nothing but the memory and the positions it can hold.
        - `dtype`: `None` stores keys and values in the model's dtype (exact); `"int8"`
          stores them as int8 with a float32 scale per row (see [`eqrope.KVCache`][]).
        - `chunk`: how many rows attention reads at a time; it never changes a result.

        An unstacked model's cache holds each block's rows in its own buffers (see
        [`eqrope.KVCache`][]); an unstacked model also takes a stacked cache.
        """
        return KVCache.empty(
            self.config, batch=batch, max_len=max_len, dtype=dtype, chunk=chunk,
            per_block=self.layout == "unstacked",
        )  # fmt: skip

    def prefill(
        self,
        ids: Int[ArrayLike, " seq"],
        cache: KVCache,
        pos: Int[ArrayLike, ""] = 0,
        *,
        check: bool = True,
        kv_bound: Int[Array, ""] | None = None,
        kv_low: Int[Array, ""] | None = None,
        logits_at: Int[Array, " rows"] | None = None,
    ) -> tuple[Float[Array, "rows vocab"], KVCache]:
        """Run `ids` at positions `pos .. pos + seq - 1` in one pass against `cache`.

        Each query attends to the cache rows before `pos` and causally to the new rows (the
        offset mask, the chapter's `diagonal = 1 + Tk - Tq`). The new keys and values are
        written to rows `pos .. pos + seq - 1`.

        A prompt may be padded to a fixed length so that a new prompt length does not
        recompile: the logits of the real tokens do not see the pads, and the rows written
        for the pads are masked until a later step overwrites them.

        `check=False` skips the value checks (token ids in range, `pos + seq <= rows`),
        which cost compile time inside loops; only for callers that have checked already,
        such as [`eqrope.generate`][]. Shapes and dtypes are always checked.

        The cache is read in chunks of `cache.chunk` rows, and chunks at or past
        `kv_bound` (default `pos`) are skipped, so the cost follows the position, not
        `max_len`. With a sliding window, chunks wholly before the window of position
        `kv_low` (default `pos`) are skipped too, so the cost follows the window. Under
        `jax.vmap` over a batch with different positions, pass an unbatched `kv_bound`
        (the batch's largest `pos`) and `kv_low` (its smallest), or every chunk is
        computed. Neither changes the result.

        `logits_at` picks the rows of `ids` whose logits are computed (default: every
        row): a prefill that needs only its last token's logits skips the head's product
        for the others (the largest product of a model with a large vocabulary).

        **Returns:** `(logits, cache)`, logits for every row of `ids` (or those of `logits_at`).
        """
        if not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a KVCache, got {type(cache).__name__}.")
        cache.check(self.config)
        if cache.per_block and self.layout == "stacked":
            raise TypeError(
                "cache has one buffer per block (from an unstacked model's init_cache), but "
                "this model is stacked; use model.unstacked(), or a cache from this "
                "model's init_cache()."
            )
        if check:
            ids = self._check_ids(ids, "ids")
            pos = cache.check_position(check_span(pos, ids.shape[0], cache.max_len, "pos"), ids.shape[0])
        else:
            ids = on_device(as_int_array(ids, "ids", ndim=1))
            pos = jnp.asarray(pos).astype(jnp.int32)
        if all(map(is_concrete, jax.tree.leaves((self, ids, cache, pos, kv_bound, kv_low, logits_at)))):
            # Called outside any transformation: one compiled program per shape, with `pos`
            # an array by now, so a loop over Python int positions compiles once.
            return _prefill_compiled(self, ids, cache, pos, kv_bound, kv_low, logits_at)
        positions = pos + jnp.arange(ids.shape[0], dtype=jnp.int32)
        if cache.per_block and not cache.quantized:
            x = self._embed(ids, positions)
            x, cache = decode_in_place(self.blocks, self.config, x, positions, cache, kv_bound, kv_low)
            x = x if logits_at is None else x[logits_at]
            return self._logits(x), cache.advance(pos, ids.shape[0])
        logits, keys, values = self.forward(
            ids, positions, cache, kv_bound=kv_bound, kv_low=kv_low, logits_at=logits_at
        )
        return logits, cache.write(keys, values, pos)

    def step(
        self,
        token: Int[ArrayLike, ""],
        cache: KVCache,
        pos: Int[ArrayLike, ""],
        *,
        check: bool = True,
        kv_bound: Int[Array, ""] | None = None,
        kv_low: Int[Array, ""] | None = None,
    ) -> tuple[Float[Array, " vocab"], KVCache]:
        """One token at position `pos`: writes row `pos`, attends to rows `0 .. pos`.

        `check`, `kv_bound` and `kv_low` are as for `prefill`.

        Called outside any `jit` (the seed's `for t in range(n)` loop), `step` and
        `prefill` run as one compiled program per shape, with `pos` made an array first,
        so a Python int position compiles nothing new. In a function you compile yourself,
        pass `pos` as an array (`jnp.asarray(t, jnp.int32)`): `jax.jit` and
        `eqx.filter_jit` take a Python int argument as a constant, one program per value.

        **Returns:** `(logits, cache)`, the logits for the next position.
        """
        hint = " Pass one token id; for a batch use jax.vmap."
        token = as_int_array(token, "token", ndim=0, hint=hint)
        logits, cache = self.prefill(
            token[None], cache, pos, check=check, kv_bound=kv_bound, kv_low=kv_low
        )
        return logits[0], cache

    # -- checks --------------------------------------------------------------------------

    def _check_ids(self, ids, name: str):
        ids = as_int_array(
            ids,
            name,
            ndim=1,
            hint=" The model runs one sequence; for a batch use jax.vmap(model)(ids).",
        )
        if ids.shape[0] == 0:
            raise ValueError(f"{name} is empty; pass at least one token.")
        if ids.shape[0] > self.config.max_len:
            raise ValueError(
                f"{name} has {ids.shape[0]} tokens but max_len={self.config.max_len}; "
                "shorten the sequence or build the model with a larger max_len."
            )
        return on_device(check_vocab(ids, self.config.vocab_size, name))


@eqx.filter_jit
def _prefill_compiled(model, ids, cache, pos, kv_bound, kv_low, logits_at):
    """`model.prefill` (checked already) as one program: what an eager `prefill` or
    `step` runs. Eagerly, a stacked model's scan over blocks would compile at every call."""
    return model.prefill(ids, cache, pos, check=False, kv_bound=kv_bound, kv_low=kv_low, logits_at=logits_at)
