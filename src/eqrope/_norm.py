"""Normalisation layers, applied row by row over a sequence.

Both are Equinox's own layers: `eqx.nn.RMSNorm` matches Zhang & Sennrich (2019) Eq. (4)
with an eps inside the root, `x / sqrt(mean(x^2) + eps) * weight`, computes in (at least)
float32 and casts back to the input dtype, which is exactly what we need, so we do not
re-implement it. `eqx.nn.LayerNorm` is used for the textbook's `norm="layer"` variant.
They act on one vector; `norm_rows` maps them over the sequence.
"""

import equinox as eqx
import jax
from jaxtyping import Array, Float


def make_norm(kind: str, d_model: int, eps: float, dtype) -> eqx.Module:
    """An RMSNorm (weight only) or a LayerNorm (weight and bias) of width `d_model`."""
    if kind == "rms":
        return eqx.nn.RMSNorm(d_model, eps=eps, use_weight=True, use_bias=False, dtype=dtype)
    if kind == "layer":
        return eqx.nn.LayerNorm(d_model, eps=eps, use_weight=True, use_bias=True, dtype=dtype)
    raise ValueError(f"norm must be 'rms' or 'layer', got {kind!r}.")


def norm_rows(norm: eqx.Module, x: Float[Array, "seq d_model"]) -> Float[Array, "seq d_model"]:
    """Apply a one-vector norm to every row of `x`."""
    return jax.vmap(norm)(x)
