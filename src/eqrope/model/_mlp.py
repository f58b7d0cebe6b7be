"""Position-wise feed-forward layers: SwiGLU (the default) and a GELU MLP."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from ._init import uniform_weight
from ._matmul import matmul


class SwiGLU(eqx.Module):
    """`FFN(x) = (silu(x W_gate) * (x W_up)) W_down`, Shazeer 2020 Eq. (6).

    The gate and up projections are one fused `(d_model, 2 * d_ff)` matrix: one matmul.
    The paper has no biases; `bias=True` adds them for experiments.

    ??? cite "Reference"

        Shazeer 2020, "GLU Variants Improve Transformer", Eq. (6).
    """

    w_gate_up: Float[Array, "d_model two_d_ff"]
    w_down: Float[Array, "d_ff d_model"]
    b_gate_up: Float[Array, " two_d_ff"] | None
    b_down: Float[Array, " d_model"] | None

    def __init__(self, d_model: int, d_ff: int, *, bias: bool = False, dtype=jnp.float32, key: PRNGKeyArray):
        gate_key, up_key, down_key = jax.random.split(key, 3)
        gate = uniform_weight(gate_key, d_model, (d_model, d_ff), dtype)
        up = uniform_weight(up_key, d_model, (d_model, d_ff), dtype)
        self.w_gate_up = jnp.concatenate([gate, up], axis=1)
        self.w_down = uniform_weight(down_key, d_ff, (d_ff, d_model), dtype)
        self.b_gate_up = jnp.zeros((2 * d_ff,), dtype) if bias else None
        self.b_down = jnp.zeros((d_model,), dtype) if bias else None

    def __call__(self, x: Float[Array, "seq d_model"]) -> Float[Array, "seq d_model"]:
        h = matmul(x, self.w_gate_up)
        if self.b_gate_up is not None:
            h = h + self.b_gate_up
        gate, up = jnp.split(h, 2, axis=-1)
        out = matmul(jax.nn.silu(gate) * up, self.w_down)
        if self.b_down is not None:
            out = out + self.b_down
        return out


class GeluMLP(eqx.Module):
    """`FFN(x) = gelu(x W_1 + b_1) W_2 + b_2`, the GPT-2 / textbook feed-forward layer."""

    w_in: Float[Array, "d_model d_ff"]
    w_out: Float[Array, "d_ff d_model"]
    b_in: Float[Array, " d_ff"] | None
    b_out: Float[Array, " d_model"] | None

    def __init__(self, d_model: int, d_ff: int, *, bias: bool = True, dtype=jnp.float32, key: PRNGKeyArray):
        in_key, out_key = jax.random.split(key)
        self.w_in = uniform_weight(in_key, d_model, (d_model, d_ff), dtype)
        self.w_out = uniform_weight(out_key, d_ff, (d_ff, d_model), dtype)
        self.b_in = jnp.zeros((d_ff,), dtype) if bias else None
        self.b_out = jnp.zeros((d_model,), dtype) if bias else None

    def __call__(self, x: Float[Array, "seq d_model"]) -> Float[Array, "seq d_model"]:
        h = matmul(x, self.w_in)
        if self.b_in is not None:
            h = h + self.b_in
        out = matmul(jax.nn.gelu(h, approximate=False), self.w_out)
        if self.b_out is not None:
            out = out + self.b_out
        return out
