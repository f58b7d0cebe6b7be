"""Normalisation layers, applied row by row over a sequence.

The parameters are Equinox's own layers: `eqx.nn.RMSNorm` (weight only) and, for the
textbook's `norm="layer"` variant, `eqx.nn.LayerNorm` (weight and bias). The computation
is ours, because theirs squares the input directly: in float32 the mean of squares of a
vector with entries above ~1e19 overflows to inf and the output becomes exactly zero.
We scale the vector by a power of two `s` close to `max|x|` first, which changes nothing
mathematically,

    x / sqrt(mean(x^2) + eps) == (x/s) / sqrt(mean((x/s)^2) + eps/s^2),

and nothing numerically for ordinary inputs either, since dividing by a power of two is
exact. The statistic is computed in (at least) float32 and the result cast back to the
input dtype.

??? cite "Zhang & Sennrich (2019), Eq. (4)"

    ```bibtex
    @inproceedings{zhang2019root,
      title={Root Mean Square Layer Normalization},
      author={Zhang, Biao and Sennrich, Rico},
      booktitle={Advances in Neural Information Processing Systems},
      year={2019}
    }
    ```
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float


def make_norm(kind: str, d_model: int, eps: float, dtype) -> eqx.Module:
    """An RMSNorm (weight only) or a LayerNorm (weight and bias) of width `d_model`."""
    if kind == "rms":
        return eqx.nn.RMSNorm(d_model, eps=eps, use_weight=True, use_bias=False, dtype=dtype)
    if kind == "layer":
        return eqx.nn.LayerNorm(d_model, eps=eps, use_weight=True, use_bias=True, dtype=dtype)
    raise ValueError(f"norm must be 'rms' or 'layer', got {kind!r}.")


def norm_rows(norm: eqx.Module, x: Float[Array, "seq d_model"]) -> Float[Array, "seq d_model"]:
    """Apply `norm` (an RMSNorm or a LayerNorm of width `d_model`) to every row of `x`."""
    return jax.vmap(lambda row: _norm_one(norm, row))(x)


def norm_heads(
    norm: eqx.nn.RMSNorm, x: Float[Array, "seq heads head_dim"]
) -> Float[Array, "seq heads head_dim"]:
    """Apply `norm` (of width `head_dim`) to every head of every row (Qwen3's q/k norm)."""
    return jax.vmap(jax.vmap(lambda row: _norm_one(norm, row)))(x)


def _norm_one(norm: eqx.Module, x: Float[Array, " d_model"]) -> Float[Array, " d_model"]:
    """`x / sqrt(mean(x^2) + eps) * weight` (RMSNorm), or the same of `x - mean(x)` plus a
    bias (LayerNorm), computed so that it cannot overflow."""
    with jax.numpy_dtype_promotion("standard"):
        dtype = jnp.result_type(x.dtype, jnp.float32)
    y = x.astype(dtype)
    # s: the power of two with s <= max|x| < 2s, so |x/s| < 2 (s = 1 for max|x| <= 1,
    # where nothing can overflow). The result does not depend on s: no gradient through it.
    m = jax.lax.stop_gradient(jnp.max(jnp.abs(y)))
    s = _power_of_two_below(jnp.where(jnp.isfinite(m) & (m > 1), m, 1))
    y = y / s
    if isinstance(norm, eqx.nn.LayerNorm):
        y = y - jnp.mean(y)
    y = y * jax.lax.rsqrt(jnp.mean(y * y) + norm.eps / (s * s))
    if norm.weight is not None:
        y = y * norm.weight.astype(dtype)
    if getattr(norm, "bias", None) is not None:
        y = y + norm.bias.astype(dtype)
    return y.astype(x.dtype)


# The exponent bits of an IEEE float32 and float64, as unsigned integers of their width.
_EXPONENT_BITS = {
    jnp.dtype(jnp.float32): (jnp.uint32, 0x7F800000),
    jnp.dtype(jnp.float64): (jnp.uint64, 0x7FF0000000000000),
}


def _power_of_two_below(m: Float[Array, ""]) -> Float[Array, ""]:
    """The power of two `s` with `s <= m < 2s`, for a finite normal `m > 0` in float32
    or float64: `m` with its mantissa bits cleared, two operations where `frexp` and
    `ldexp` lower to dozens (each norm is in every compiled program several times)."""
    uint, mask = _EXPONENT_BITS[m.dtype]
    bits = jax.lax.bitcast_convert_type(m, uint) & jnp.asarray(mask, uint)
    return jax.lax.bitcast_convert_type(bits, m.dtype)
