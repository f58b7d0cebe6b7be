"""The pre-norm decoder block, read as literal residual code."""

import equinox as eqx
import jax
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ._attention import CausalSelfAttention
from ._cache import BlockCache, KVCache
from ._config import DecoderConfig
from ._mlp import GeluMLP, SwiGLU
from ._norm import make_norm, norm_rows


class DecoderBlock(eqx.Module):
    """`x + attn(norm(x))`, then `x + mlp(norm(x))`.

    Pre-norm, as in GPT-2 and Llama; Vaswani et al. (2017) normalise after the residual sum.
    """

    attn_norm: eqx.nn.RMSNorm | eqx.nn.LayerNorm
    attn: CausalSelfAttention
    mlp_norm: eqx.nn.RMSNorm | eqx.nn.LayerNorm
    mlp: SwiGLU | GeluMLP

    def __init__(self, config: DecoderConfig, *, key: PRNGKeyArray):
        attn_key, mlp_key = jax.random.split(key)
        dtype = config.jnp_dtype
        self.attn_norm = make_norm(config.norm, config.d_model, config.norm_eps, dtype)
        self.attn = CausalSelfAttention(
            config.d_model,
            config.n_heads,
            config.n_kv_heads,
            head_dim=config.head_dim,
            bias=config.has_out_bias,
            qkv_bias=config.has_qkv_bias,
            qk_norm=config.attention.qk_norm,
            norm_eps=config.norm_eps,
            rope=config.positions == "rope",
            rope_base=config.rope_base,
            rope_scaling=config.rope_scaling,
            dtype=dtype,
            key=attn_key,
        )
        self.mlp_norm = make_norm(config.norm, config.d_model, config.norm_eps, dtype)
        mlp_cls = SwiGLU if config.mlp == "swiglu" else GeluMLP
        self.mlp = mlp_cls(config.d_model, config.d_ff, bias=config.bias, dtype=dtype, key=mlp_key)

    def __call__(
        self,
        x: Float[Array, "seq d_model"],
        positions: Int[Array, " seq"],
        past: BlockCache | None = None,
        window: Int[Array, ""] | None = None,
    ) -> tuple[
        Float[Array, "seq d_model"],
        Float[Array, "kv_heads seq head_dim"],
        Float[Array, "kv_heads seq head_dim"],
    ]:
        """**Returns:** `(x, k, v)`: the block's output and its new rows' keys and values.

        `past` (this block's cache rows) and `window` (a sliding window, if this block has
        one) are passed to [`eqrope.CausalSelfAttention`][].
        """
        h, k, v = self.attn(norm_rows(self.attn_norm, x), positions, past, window)
        x = x + h
        x = x + self.mlp(norm_rows(self.mlp_norm, x))
        return x, k, v

    def decode(
        self,
        x: Float[Array, "seq d_model"],
        positions: Int[Array, " seq"],
        cache: KVCache,
        index: int,
        window: Int[Array, ""] | None = None,
        bound: Int[Array, ""] | None = None,
        low: Int[Array, ""] | None = None,
    ) -> tuple[Float[Array, "seq d_model"], KVCache]:
        """`__call__` against a per-block float cache, which takes the block's new rows
        first ([`eqrope.CausalSelfAttention.decode`][]). **Returns:** `(x, cache)`."""
        h, cache = self.attn.decode(norm_rows(self.attn_norm, x), positions, cache, index, window, bound, low)
        x = x + h
        x = x + self.mlp(norm_rows(self.mlp_norm, x))
        return x, cache
