"""Normalisation layers, applied row by row over a sequence.

The parameters are Equinox's own layers: `eqx.nn.RMSNorm` (weight only) and, for the
textbook's `norm="layer"` variant, `eqx.nn.LayerNorm` (weight and bias). The computation
is ours, because theirs squares the input directly: in float32 the mean of squares of a
vector with entries above ~1e19 overflows to inf and the output becomes exactly zero.
We also take the mean of squares of `x c`, `c = 2^-k` (`k` = 80 in float32, 672 in
float64), in the same pass over `x`, and use it where the plain one passes `2^k` (or
overflows), since

    x / sqrt(mean(x^2) + eps) == (x c) / sqrt(mean((x c)^2) + eps c^2),

and multiplying by a power of two is exact. The switch comes before the overflow for the
gradient: the derivative of `rsqrt(m)`, `-m^-1.5 / 2`, is flushed to 0 once `m` passes
`2^84` (float32), which dropped the gradient's term through the statistic (a 20% error
on rows of 1e13 to 1e19). With the switch at `2^k` both statistics stay where that
derivative is a normal number for rows up to an RMS of `2^122` (float32); past ~1e35
the gradient, of the order of `1 / rms`, is in float32's subnormals anyway. Where the scaled statistic is
taken, the entries are large enough that the largest scaled squares neither underflow
nor overflow, and a sum of up to `2^32` of them fits. The row is multiplied by `c` first
and then by the inverse root: the single factor `c / rms(x)` would be subnormal once
`rms(x)` passes `2^126` (float32), and XLA:CPU flushes it to 0. LayerNorm centres `x c`
too, since the mean of `x` itself overflows once the row's sum does. The statistic is
computed in (at least) float32 and the result cast back to the input dtype.

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
    return _norm_last(norm, x)


def norm_heads(
    norm: eqx.nn.RMSNorm, x: Float[Array, "seq heads head_dim"]
) -> Float[Array, "seq heads head_dim"]:
    """Apply `norm` (of width `head_dim`) to every head of every row (Qwen3's q/k norm)."""
    return _norm_last(norm, x)


def _norm_last(norm: eqx.Module, x: Float[Array, "*rows width"]) -> Float[Array, "*rows width"]:
    """`x / sqrt(mean(x^2) + eps) * weight` (RMSNorm), or the same of `x - mean(x)` plus a
    bias (LayerNorm), over the last axis, computed so that it cannot overflow.

    Written over the whole array with `lax` selects rather than as `jax.vmap` of one row:
    the same XLA program, traced without batching every operation and without the nested
    function each `jnp.where` is (a deep unrolled model traces four norms a block).
    """
    with jax.numpy_dtype_promotion("standard"):
        dtype = jnp.result_type(x.dtype, jnp.float32)
    c = _SCALE[jnp.dtype(dtype)]
    y = x.astype(dtype)
    # The row and its scaled copy side by side, `(*rows, 2, width)`, so that both
    # statistics are one reduction (one kernel) and each is the usual one of its row,
    # bitwise. `y` and `ys` are formed again for the output, so that XLA fuses `both`
    # into the reductions instead of writing it out.
    both = y[..., None, :] * jnp.asarray([[1], [c]], dtype)
    ys = y * jnp.asarray(c, dtype)
    select = lambda p, a, b: jax.lax.select(jnp.broadcast_to(p, a.shape), a, b)  # noqa: E731
    layer = isinstance(norm, eqx.nn.LayerNorm)
    if layer:
        # Where the plain mean overflows (the row's sum does), that branch is not taken;
        # it is zeroed so that its inf gives no NaN gradient. `ys` is centred as scaled.
        means = jnp.mean(both, axis=-1, keepdims=True)  # (*rows, 2, 1)
        centred = jnp.isfinite(means)  # the scaled mean always is
        means = select(centred, means, jnp.zeros_like(means))
        both = select(centred, both - means, jnp.zeros_like(both))
        y = select(centred[..., 0, :], y - means[..., 0, :], jnp.zeros_like(y))
        ys = ys - means[..., 1, :]
    squares = jnp.mean(both * both, axis=-1, keepdims=True)  # (*rows, 2, 1)
    plain, scaled = squares[..., 0, :], squares[..., 1, :]
    fits = plain <= 1 / c  # false for inf (and NaN)
    fits = fits & centred[..., 0, :] if layer else fits
    # `eps c^2` underflows, and is negligible where the plain statistic passed `2^k`; the
    # smallest normal number in its place keeps a constant row's `0 * rsqrt` at 0, and is
    # far below any non-zero scaled statistic (huge entries differ by at least their ulp).
    # The statistic not taken is selected away before the rsqrt, so neither its inf nor
    # a zero's infinite derivative reaches a gradient.
    eps_scaled = max(norm.eps * c**2, float(jnp.finfo(dtype).tiny))
    y = select(fits, y, ys) * jax.lax.rsqrt(select(fits, plain + norm.eps, scaled + eps_scaled))
    if norm.weight is not None:
        y = y * norm.weight.astype(dtype)
    if getattr(norm, "bias", None) is not None:
        y = y + norm.bias.astype(dtype)
    return y.astype(x.dtype)


# `c = 2^-k` for the scaled statistic, taken where the plain one passes `2^k` (module
# docstring). float32: below `2^80`, `m^-1.5` is above `2^-120`; a scaled statistic is in
# `(2^-80, 2^96)`, `m^-1.5` below `2^120`. float64: likewise `2^672` against the range's
# `2^-1022 .. 2^1024`.
_SCALE = {jnp.dtype(jnp.float32): 2.0**-80, jnp.dtype(jnp.float64): 2.0**-672}
