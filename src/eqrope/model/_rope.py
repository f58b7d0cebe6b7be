"""Rotary position embeddings as a pure function of explicit positions.

Note: `eqx.nn.RotaryPositionalEmbedding` does not fit here, so do not "simplify" back to
it. It pairs dimension i with i + head_dim/2 ("rotate-half", the GPT-NeoX/Hugging Face
layout) where RoFormer Eq. (15) pairs (x[2i], x[2i+1]); it takes no positions, so a
cached decode step at position t cannot be expressed; and its table cache ignores theta.
"""

import math

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from .._checks import check_float, check_int
from .._custom_types import IntLike, RealLike
from ._config import RopeScaling


def rope_inv_freq(
    head_dim: IntLike, base: RealLike = 10000.0, scaling: RopeScaling | None = None
) -> Float[Array, " half"]:
    """The rotation rates `theta_i = base^(-2i/head_dim)`, `i = 0 .. head_dim/2 - 1`.

    Computed in float32 (as Hugging Face does), optionally rescaled by `scaling` with the
    arithmetic of transformers' rope initialisation functions (`ROPE_INIT_FUNCTIONS`).

    ??? cite "Reference"

        Su et al. 2021, RoFormer, Eq. (15); the `llama3` rule is Meta's Llama 3.1 release;
        `yarn` is Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large
        Language Models", Eqs. (17)-(21); `dynamic` is the NTK-aware base of bloc97 and
        emozilla, as transformers computes it.
    """
    head_dim = check_int(head_dim, "rope_inv_freq: head_dim", minimum=2)
    base = check_float(base, "rope_inv_freq: base")
    if head_dim % 2 != 0:
        raise ValueError(f"head_dim must be even for rotary embeddings, got {head_dim}.")
    if scaling is not None and scaling.kind == "dynamic":
        base = _ntk_base(head_dim, base, scaling)
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(
        head_dim
    )
    # transformers raises the float32 base to float32 exponents.
    powers = (np.float32(base) ** exponents).astype(np.float32)
    inv_freq = (1.0 / powers).astype(np.float32)
    if scaling is not None and scaling.kind == "yarn":
        inv_freq = _yarn(inv_freq, powers, base, scaling)
    elif scaling is not None and scaling.kind != "dynamic":
        inv_freq = _rescale(inv_freq, scaling)
    return jnp.asarray(inv_freq, dtype=jnp.float32)


def rope_attention_factor(scaling: RopeScaling | None) -> float:
    """The number cosines and sines are multiplied by: 1 except for `yarn`, where it is
    `scaling.attention_factor`, or `0.1 ln(factor) + 1` when that is `None` (1 for
    `factor <= 1`), as transformers' `_compute_yarn_parameters` has it."""
    if scaling is None or scaling.kind != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    return yarn_mscale(scaling.factor)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's `0.1 * mscale * ln(factor) + 1`, 1 for `factor <= 1` (transformers' `get_mscale`)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _rescale(inv_freq: np.ndarray, scaling: RopeScaling) -> np.ndarray:
    factor = np.float32(scaling.factor)
    if scaling.kind == "linear":
        return (inv_freq / factor).astype(np.float32)
    # llama3: the rule of transformers' `_compute_llama3_parameters`.
    old_len = np.float32(scaling.original_max_len)
    low, high = np.float32(scaling.low_freq_factor), np.float32(scaling.high_freq_factor)
    low_freq_wavelen = old_len / low
    high_freq_wavelen = old_len / high
    wavelen = np.float32(2 * math.pi) / inv_freq
    out = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(medium, smoothed, out).astype(np.float32)


def _ntk_base(head_dim: int, base: float, scaling: RopeScaling) -> float:
    """transformers' `_compute_dynamic_ntk_parameters` at `seq_len = scaling.max_len`, in
    double precision as it computes the base for an integer `seq_len`."""
    if head_dim <= 2:
        raise ValueError(
            f"dynamic rope scaling needs head_dim > 2 (it raises the base to "
            f"head_dim / (head_dim - 2)), got {head_dim}."
        )
    factor, old = scaling.factor, scaling.original_max_len
    seq_len = max(scaling.max_len, old)
    return base * ((factor * seq_len / old) - (factor - 1)) ** (head_dim / (head_dim - 2))


def _yarn(inv_freq: np.ndarray, powers: np.ndarray, base: float, s: RopeScaling) -> np.ndarray:
    """transformers' `_compute_yarn_parameters`, in its float32 and double arithmetic."""
    dim = 2 * inv_freq.shape[0]

    def correction_dim(rotations):
        return dim * math.log(s.original_max_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = (np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low)
    keep = (1 - np.clip(ramp, 0, 1)).astype(np.float32)  # 1: extrapolate, 0: interpolate
    interpolated = (1.0 / (np.float32(s.factor) * powers)).astype(np.float32)
    return (interpolated * (1 - keep) + inv_freq * keep).astype(np.float32)


def apply_rope(
    x: Float[Array, "seq heads head_dim"],
    positions: Int[Array, " seq"],
    inv_freq: Float[Array, " half"],
    scale: RealLike = 1.0,
) -> Float[Array, "seq heads head_dim"]:
    """Rotate each pair `(x[2i], x[2i+1])` of every head by `positions * inv_freq[i]`.

    Angles, cosines and sines are float32 whatever `x.dtype`; the result is cast back.
    Apply it to queries and keys, never to values.

    **Arguments:**

    - `x`: queries or keys, one row per position.
    - `positions`: the integer position of each row (any signed integer dtype).
    - `inv_freq`: the rates from [`eqrope.rope_inv_freq`][].
    - `scale`: cosines and sines are multiplied by it (YaRN's attention factor, from
      `eqrope.model._rope.rope_attention_factor`), so `q . k` is multiplied by its square.

    **Returns:** the rotated `x`, same shape and dtype.

    ??? cite "Reference"

        Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary Position Embedding",
        Eq. (15).
    """
    scale = check_float(scale, "apply_rope: scale")
    if x.shape[-1] != 2 * inv_freq.shape[0]:
        raise ValueError(
            f"apply_rope: x has head_dim {x.shape[-1]} but inv_freq has "
            f"{inv_freq.shape[0]} rates; head_dim must be 2 * len(inv_freq)."
        )
    angles = positions.astype(jnp.float32)[:, None] * inv_freq.astype(jnp.float32)[None, :]
    cos = jnp.cos(angles)[:, None, :]
    sin = jnp.sin(angles)[:, None, :]
    if scale != 1.0:
        cos, sin = cos * jnp.float32(scale), sin * jnp.float32(scale)
    # Each pair `(x1, x2)` becomes `(x1, x2) cos + (-x2, x1) sin`: the same sums as
    # `(x1 cos - x2 sin, x1 sin + x2 cos)` (bitwise, for the same cosines and sines), but
    # elementwise over `x` with a reversal of each pair, and no stacking of two halves,
    # which XLA wrote out in a kernel of its own where the rotated rows have two readers
    # (queries and keys, rotated in one pass).
    pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
    swapped = pairs[..., ::-1] * jnp.asarray([-1, 1], jnp.float32)
    rotated = pairs * cos[..., None] + swapped * sin[..., None]
    return rotated.reshape(x.shape).astype(x.dtype)
