"""Causal self-attention with rotary positions, grouped key/value heads and a read-only past."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ._cache import BlockCache, KVCache
from ._config import RopeScaling
from ._init import uniform_weight
from ._kernel import attend, attend_cache, empty_state, finish, merge, merge_cache
from ._matmul import matmul
from ._norm import norm_heads
from ._rope import apply_rope, rope_attention_factor, rope_inv_freq


class CausalSelfAttention(eqx.Module):
    """Multi-head causal self-attention (Vaswani et al. 2017, section 3.2.1).

    Queries and keys are rotated by their positions (RoFormer Eq. 15); values are not.
    `n_kv_heads < n_heads` gives grouped-query attention (`n_kv_heads = 1`: multi-query).
    The query, key and value projections are one fused matrix, so a step is one matmul.
    Scores are scaled by `1/sqrt(head_dim)` (and by the square of YaRN's attention factor,
    which multiplies the rotation's cosines and sines). Scores, softmax and the weighted
    sum of the values run in float32, or in float64 for a float64 model.

    The variants of the checkpoint families (see [`eqrope.AttentionOptions`][]): a head
    width other than `d_model / n_heads`, biases on the q/k/v projections only, an
    RMSNorm on each query and key head before the rotation, and a sliding window, which is
    not a field but an argument of the call, because the stacked blocks share their fields
    and Qwen2 windows only some blocks.

    The layer never writes a cache. It takes the cached keys and values of earlier
    positions (`past`, read only) and returns the new rows' keys (already rotated) and
    values, for the caller to store.
    """

    wqkv: Float[Array, "d_model qkv"]
    wo: Float[Array, "heads_by_dim d_model"]
    bqkv: Float[Array, " qkv"] | None
    bo: Float[Array, " d_model"] | None
    q_norm: eqx.nn.RMSNorm | None
    k_norm: eqx.nn.RMSNorm | None
    n_heads: int = eqx.field(static=True)
    n_kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    rope: bool = eqx.field(static=True)
    rope_base: float = eqx.field(static=True)
    rope_scaling: RopeScaling | None = eqx.field(static=True)

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int,
        *,
        head_dim: int | None = None,
        bias: bool = False,
        qkv_bias: bool | None = None,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
        rope: bool = True,
        rope_base: float = 10000.0,
        rope_scaling: RopeScaling | None = None,
        dtype=jnp.float32,
        key: PRNGKeyArray,
    ):
        """`bias` puts biases on the q/k/v and output projections; `qkv_bias` (default:
        `bias`) on the q/k/v projections alone. `head_dim` defaults to `d_model //
        n_heads`; `qk_norm` adds RMSNorms of `head_dim` with `norm_eps`."""
        qkv_key, out_key = jax.random.split(key)
        head_dim = d_model // n_heads if head_dim is None else head_dim
        qkv = (n_heads + 2 * n_kv_heads) * head_dim
        self.wqkv = uniform_weight(qkv_key, d_model, (d_model, qkv), dtype)
        self.wo = uniform_weight(out_key, n_heads * head_dim, (n_heads * head_dim, d_model), dtype)
        self.bqkv = jnp.zeros((qkv,), dtype) if (bias if qkv_bias is None else qkv_bias) else None
        self.bo = jnp.zeros((d_model,), dtype) if bias else None
        norm = lambda: eqx.nn.RMSNorm(head_dim, eps=norm_eps, use_bias=False, dtype=dtype)  # noqa: E731
        self.q_norm = norm() if qk_norm else None
        self.k_norm = norm() if qk_norm else None
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.rope = rope
        self.rope_base = float(rope_base)
        self.rope_scaling = rope_scaling

    def project(
        self, x: Float[Array, "seq d_model"], positions: Int[Array, " seq"]
    ) -> tuple[
        Float[Array, "seq heads head_dim"],
        Float[Array, "seq kv_heads head_dim"],
        Float[Array, "seq kv_heads head_dim"],
    ]:
        """Queries, keys and values of `x`; queries and keys rotated to `positions`."""
        seq = x.shape[0]
        qkv = matmul(x, self.wqkv)
        if self.bqkv is not None:
            qkv = qkv + self.bqkv
        nq, nkv, hd = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim, self.head_dim
        v = qkv[:, nq + nkv :].reshape(seq, self.n_kv_heads, hd)
        # Queries and keys side by side, one head axis: rotated in one pass (the rotation
        # is per head, so this is the two rotations, with half the program).
        qk = qkv[:, : nq + nkv].reshape(seq, self.n_heads + self.n_kv_heads, hd)
        if self.q_norm is not None:
            q, k = jnp.split(qk, [self.n_heads], axis=1)
            qk = jnp.concatenate([norm_heads(self.q_norm, q), norm_heads(self.k_norm, k)], axis=1)
        if self.rope:
            inv_freq = rope_inv_freq(hd, self.rope_base, self.rope_scaling)
            qk = apply_rope(qk, positions, inv_freq, rope_attention_factor(self.rope_scaling))
        q, k = jnp.split(qk, [self.n_heads], axis=1)
        return q, k, v

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
        """Attend from `x` (at `positions`) to itself causally and to the valid past rows.

        **Arguments:**

        - `x`: the normalised inputs, one row per position.
        - `positions`: consecutive integer positions of the rows, starting at `positions[0]`.
        - `past`: optional view of this block's cache (`KVCache.block`); rows
          `r < positions[0]` are attended and every later row is masked (it is stale or
          not yet written). The view says how the rows are read; see
          `eqrope.model._kernel.merge_cache`.
        - `window`: if given, the query at position `p` sees only positions
          `p - window + 1 .. p` (sliding-window attention), and cache chunks wholly
          before the first query's window are not read.

        **Returns:** `(out, k, v)`: the attention output and the keys (rotated) and values
        of the rows of `x`, heads-major `(kv_heads, seq, head_dim)` as the cache stores them.
        """
        q, k, v = self.project(x, positions)
        seq = x.shape[0]
        group = self.n_heads // self.n_kv_heads
        qg = q.reshape(seq, self.n_kv_heads, group, self.head_dim)
        k, v = jnp.transpose(k, (1, 0, 2)), jnp.transpose(v, (1, 0, 2))
        causal = positions[None, :] <= positions[:, None]
        if window is not None:
            causal = causal & (positions[None, :] > positions[:, None] - window)
        if past is None:  # no cache (training, the full pass): one plain softmax
            out = attend(qg, k, v, causal).astype(v.dtype)
        else:
            state = empty_state(self.n_kv_heads, group, seq, self.head_dim, q.dtype)
            state = merge_cache(state, qg, past, positions, window)
            out = finish(merge(state, qg, k, v, causal)).astype(v.dtype)
        out = matmul(out.reshape(seq, self.n_heads * self.head_dim), self.wo)
        if self.bo is not None:
            out = out + self.bo
        return out, k, v

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
        """`__call__` against a per-block float cache, written first: the rows of `x` go
        to block `index`'s own buffers, then each query attends to that block's rows up
        to its position in one pass, as a minimal decoder does (no separate pass over
        the new rows). `bound` and `low` are as for `KVCache.block`.

        **Returns:** `(out, cache)`.
        """
        q, k, v = self.project(x, positions)
        seq = x.shape[0]
        group = self.n_heads // self.n_kv_heads
        qg = q.reshape(seq, self.n_kv_heads, group, self.head_dim)
        k, v = jnp.transpose(k, (1, 0, 2)), jnp.transpose(v, (1, 0, 2))
        cache = cache.write_block(index, k, v, positions[0])
        past = cache.block(index, bound, low)
        if past.max_len <= past.chunk:  # a short cache: one pass over all its rows
            out = attend_cache(qg, past, positions, window)
        else:
            state = empty_state(self.n_kv_heads, group, seq, self.head_dim, q.dtype)
            out = finish(merge_cache(state, qg, past, positions, window, inclusive=True))
        out = out.astype(v.dtype).reshape(seq, self.n_heads * self.head_dim)
        out = matmul(out, self.wo)
        if self.bo is not None:
            out = out + self.bo
        return out, cache
