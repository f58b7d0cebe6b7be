"""The rotary decoder: embedding, a stack of pre-norm blocks, final norm, linear head."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ._block import DecoderBlock
from ._cache import KVCache, cache_shape, empty_cache, quantize_rows
from ._checks import as_int_array, check_span, check_vocab
from ._config import DecoderConfig, RopeScaling
from ._init import uniform_weight
from ._norm import make_norm, norm_rows


class RotaryDecoder(eqx.Module):
    """A decoder-only transformer with rotary positions and a static key/value cache.

    `model(ids)` runs one sequence; batch with `jax.vmap(model)`. The `n_blocks` blocks
    are stored stacked (every array has a leading `blocks` axis) and run with
    `jax.lax.scan`, so compile time does not grow with depth.

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
    blocks: DecoderBlock
    final_norm: eqx.nn.RMSNorm | eqx.nn.LayerNorm
    head: Float[Array, "d_model vocab"] | None
    head_bias: Float[Array, " vocab"] | None
    config: DecoderConfig = eqx.field(static=True)

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        n_heads: int,
        n_blocks: int,
        max_len: int,
        *,
        d_ff: int | None = None,
        n_kv_heads: int | None = None,
        rope_base: float = 10000.0,
        rope_scaling: RopeScaling | None = None,
        positions: str = "rope",
        norm: str = "rms",
        norm_eps: float = 1e-5,
        mlp: str = "swiglu",
        bias: bool = False,
        head_bias: bool = True,
        tie_embeddings: bool = False,
        remat: bool = False,
        dtype=None,
        key: PRNGKeyArray,
    ):
        """**Arguments:** the fields of [`eqrope.DecoderConfig`][], in the seed's order
        `(vocab_size, d_model, n_heads, n_blocks, max_len)`, then keyword options, and
        `key`. `dtype=None` means float32 (also under `jax_enable_x64`).
        """
        dtype_name = "float32" if dtype is None else jnp.dtype(dtype).name
        config = DecoderConfig(
            vocab_size=vocab_size,
            d_model=d_model,
            n_heads=n_heads,
            n_blocks=n_blocks,
            max_len=max_len,
            d_ff=d_ff,
            n_kv_heads=n_kv_heads,
            rope_base=rope_base,
            rope_scaling=rope_scaling,
            positions=positions,
            norm=norm,
            norm_eps=norm_eps,
            mlp=mlp,
            bias=bias,
            head_bias=head_bias,
            tie_embeddings=tie_embeddings,
            remat=remat,
            dtype=dtype_name,
        )
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
        if tie_embeddings:
            self.head = None
        else:
            self.head = uniform_weight(head_key, d_model, (d_model, vocab_size), dt)
        self.head_bias = jnp.zeros((vocab_size,), dt) if head_bias else None

    @classmethod
    def from_config(cls, config: DecoderConfig, *, key: PRNGKeyArray) -> "RotaryDecoder":
        """Build a decoder from a [`eqrope.DecoderConfig`][]."""
        kwargs = config.to_dict()
        kwargs["rope_scaling"] = config.rope_scaling
        sizes = [kwargs.pop(n) for n in ("vocab_size", "d_model", "n_heads", "n_blocks", "max_len")]
        return cls(*sizes, **kwargs, key=key)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def max_len(self) -> int:
        return self.config.max_len

    # -- the forward pass ----------------------------------------------------------------

    def __call__(self, ids: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
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
        cache: KVCache | None = None,
        *,
        kv_bound: Int[Array, ""] | None = None,
        kv_chunk: int = 256,
    ) -> tuple[
        Float[Array, "seq vocab"],
        Float[Array, "blocks seq kv_heads head_dim"],
        Float[Array, "blocks seq kv_heads head_dim"],
    ]:
        """The unchecked core: logits and each block's new keys and values.

        `positions` must be consecutive; the cache rows `r < positions[0]` are attended,
        read in chunks of `kv_chunk` rows, skipping chunks at or past `kv_bound` (default
        `positions[0]`). Public callers want `__call__`, `prefill` or `step`, which check
        their inputs.
        """
        x = self.embed[ids]
        if self.pos_embed is not None:
            x = x + self.pos_embed[positions]
        dynamic, static = eqx.partition(self.blocks, eqx.is_array)

        def run_block(block_arrays, x, past):
            block = eqx.combine(block_arrays, static)
            return block(x, positions, past, kv_bound=kv_bound, kv_chunk=kv_chunk)

        if self.config.remat:
            run_block = eqx.filter_checkpoint(run_block)

        def body(x, xs):
            block_arrays, index = xs
            # The whole cache is closed over and each block reads its rows in place.
            past = None if cache is None else cache.block(index)
            x, k, v = run_block(block_arrays, x, past)
            return x, (k, v)

        indices = jnp.arange(self.config.n_blocks, dtype=jnp.int32)
        x, (keys, values) = jax.lax.scan(body, x, (dynamic, indices))
        x = norm_rows(self.final_norm, x)
        head = self.embed.T if self.head is None else self.head
        logits = x @ head
        if self.head_bias is not None:
            logits = logits + self.head_bias
        return logits, keys, values

    # -- the cache protocol --------------------------------------------------------------

    def init_cache(self, batch: int | None = None, *, dtype=None) -> KVCache:
        """An empty cache of `max_len` rows (with a leading `batch` axis if given).

        `dtype=None` stores keys and values in the model's dtype (exact); `dtype="int8"`
        stores them as int8 with a float32 scale per row (see [`eqrope.KVCache`][]).
        """
        if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
            raise ValueError(f"batch must be a positive int or None, got {batch!r}.")
        return empty_cache(self.config, batch, dtype)

    def prefill(
        self,
        ids: Int[Array, " seq"],
        cache: KVCache,
        pos: int | Int[Array, ""] = 0,
        *,
        check: bool = True,
        kv_bound: Int[Array, ""] | None = None,
        kv_chunk: int = 256,
    ) -> tuple[Float[Array, "seq vocab"], KVCache]:
        """Run `ids` at positions `pos .. pos + seq - 1` in one pass against `cache`.

        Each query attends to the cache rows before `pos` and causally to the new rows (the
        offset mask, the chapter's `diagonal = 1 + Tk - Tq`). The new keys and values are
        written to rows `pos .. pos + seq - 1`.

        A prompt may be padded to a fixed length so that a new prompt length does not
        recompile: the logits of the real tokens do not see the pads, and the rows written
        for the pads are masked until a later step overwrites them.

        `check=False` skips the value checks (token ids in range, `pos + seq <= max_len`),
        which cost compile time inside loops; only for callers that have checked already,
        such as [`eqrope.generate`][]. Shapes and dtypes are always checked.

        The cache is read in chunks of `kv_chunk` rows, and chunks at or past `kv_bound`
        (default `pos`) are skipped, so the cost follows the position, not `max_len`. Under
        `jax.vmap` over a batch with different positions, pass an unbatched `kv_bound`
        (the batch's largest `pos`), or every chunk is computed. Neither changes the result.

        **Returns:** `(logits, cache)`, logits for every row of `ids`.
        """
        self._check_cache(cache)
        if check:
            ids = self._check_ids(ids, "ids")
            pos = check_span(pos, ids.shape[0], self.config.max_len, "pos")
        else:
            ids = as_int_array(ids, "ids", ndim=1)
            pos = jnp.asarray(pos).astype(jnp.int32)
        positions = pos + jnp.arange(ids.shape[0], dtype=jnp.int32)
        logits, keys, values = self.forward(
            ids, positions, cache, kv_bound=kv_bound, kv_chunk=kv_chunk
        )
        return logits, write_rows(cache, keys, values, pos)

    def step(
        self,
        token: Int[Array, ""],
        cache: KVCache,
        pos: int | Int[Array, ""],
        *,
        check: bool = True,
        kv_bound: Int[Array, ""] | None = None,
        kv_chunk: int = 256,
    ) -> tuple[Float[Array, " vocab"], KVCache]:
        """One token at position `pos`: writes row `pos`, attends to rows `0 .. pos`.

        `check`, `kv_bound` and `kv_chunk` are as for `prefill`.

        **Returns:** `(logits, cache)`, the logits for the next position.
        """
        token = as_int_array(token, "token", ndim=0, hint=" Pass one token id; for a batch use jax.vmap.")
        logits, cache = self.prefill(
            token[None], cache, pos, check=check, kv_bound=kv_bound, kv_chunk=kv_chunk
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
        return check_vocab(ids, self.config.vocab_size, name)

    def _check_cache(self, cache):
        if not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a KVCache, got {type(cache).__name__}.")
        expected = cache_shape(self.config)
        if cache.keys.shape != expected or cache.values.shape != expected:
            raise ValueError(
                f"cache has shape {cache.keys.shape} but this model needs {expected} "
                "(blocks, kv_heads, max_len, head_dim); build it with model.init_cache()."
            )
        if cache.quantized:
            ok = cache.keys.dtype == jnp.int8 and cache.key_scales.shape == expected[:-1]
        else:
            ok = cache.keys.dtype == self.config.jnp_dtype == cache.values.dtype
        if not ok:
            raise ValueError(
                f"cache has dtype {cache.keys.dtype} but the model uses {self.config.dtype} "
                "(or an int8 cache with scales); build it with model.init_cache()."
            )


def write_rows(
    cache: KVCache,
    keys: Float[Array, "blocks seq kv_heads head_dim"],
    values: Float[Array, "blocks seq kv_heads head_dim"],
    pos: Int[Array, ""],
) -> KVCache:
    """A new cache with rows `pos .. pos + seq - 1` of every block replaced."""
    zero = jnp.zeros((), jnp.int32)
    pos = pos.astype(jnp.int32)
    heads_major = lambda rows: jnp.transpose(rows, (0, 2, 1, 3))
    keys, values = heads_major(keys), heads_major(values)

    def write(buffer, rows):
        return jax.lax.dynamic_update_slice(buffer, rows.astype(buffer.dtype), (zero, zero, pos, zero))

    if not cache.quantized:
        return KVCache(keys=write(cache.keys, keys), values=write(cache.values, values))
    qk, sk = quantize_rows(keys)
    qv, sv = quantize_rows(values)
    scale_at = lambda buffer, s: jax.lax.dynamic_update_slice(buffer, s, (zero, zero, pos))
    return KVCache(
        keys=write(cache.keys, qk),
        values=write(cache.values, qv),
        key_scales=scale_at(cache.key_scales, sk),
        value_scales=scale_at(cache.value_scales, sv),
    )
