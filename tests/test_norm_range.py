"""The norms over the whole float range (issue 43, B1): rows from 1e-30 to 3e38 (and to
1e308 in float64) against a float64 NumPy reference, in float32, bfloat16 and float64.

The overflow guard used to give exactly 0 (RMSNorm) once a row's RMS passed 2^126, its
factor `c / rms` being a float32 subnormal that XLA:CPU flushes, and NaN (LayerNorm) once a
row's sum overflowed, since it centred before scaling. Their gradients are checked against
a closed form in float64 too: the derivative of rsqrt at the plain statistic used to be
flushed to 0 on rows of ~1e13 to 1e19 (float32).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqrope
from eqrope.model._norm import make_norm, norm_rows


D, EPS = 64, 1e-6
# Largest |output - reference| over a row, relative to the row's largest |reference|: the
# output's own rounding (bfloat16 keeps 8 bits) plus a few roundings of the statistic.
TOLERANCE = {"float32": 1e-6, "bfloat16": 1e-2, "float64": 1e-14}
# Row maxima: every decade from 1e-30 to 3e38 (bfloat16 shares float32's exponent range;
# from 1e-300 to 1e308 in float64), both sides of RMSNorm's 2^126 and of the sum's
# overflow, and up to the largest finite number.
MAGNITUDES = {
    "float32": [*np.logspace(-30, 38, 69), 8.5e37, 2e38, 3e38, 0.999 * 3.4028235e38],
    "bfloat16": [*np.logspace(-30, 38, 69), 8.5e37, 2e38, 3e38, 3.3895e38],
    "float64": [*np.logspace(-300, 308, 609), 1.7e308, 0.999 * 1.7976931348623157e308],
}


def _reference(x, weight, bias, layer):
    """`x / sqrt(mean(x^2) + eps) * weight + bias` in float64, per row (`x` centred first
    for LayerNorm), with no intermediate overflow or underflow that matters: with `a` the
    row's largest |entry| and `y = x / a`, it is `y / sqrt(mean(y^2) + eps / a^2)`."""
    a = np.abs(x).max(-1, keepdims=True)
    y = x / a
    if layer:
        y = y - y.mean(-1, keepdims=True)
    ms = np.mean(y * y, -1, keepdims=True)
    with np.errstate(all="ignore"):  # in the branch not taken
        out = np.where(a >= 1, y / np.sqrt(ms + EPS / a**2), y * a / np.sqrt(ms * a * a + EPS))
    return out * weight + bias


def _norm(kind, dtype):
    """A norm of width `D` with random (not trivial) weight and bias."""
    norm = make_norm(kind, D, EPS, dtype)
    w_key, b_key = jax.random.split(jax.random.PRNGKey(1))
    norm = eqx.tree_at(lambda n: n.weight, norm, (1 + jax.random.normal(w_key, (D,))).astype(dtype))
    if kind == "layer":
        norm = eqx.tree_at(lambda n: n.bias, norm, jax.random.normal(b_key, (D,)).astype(dtype))
    return norm


def _rows(dtype, rng):
    """Two rows for each magnitude of `dtype`, their largest |entry| that magnitude: a
    random direction, and the same shifted by its spread (a non-zero mean)."""
    mags = np.asarray(MAGNITUDES[dtype])
    u = rng.standard_normal((2, D))
    u[1] += 1.5
    u /= np.abs(u).max(-1, keepdims=True)
    return (u[None] * mags[:, None, None]).reshape(-1, D)


@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_norm_matches_float64_from_tiny_to_huge(kind, dtype):
    wide = jnp.float64 if dtype == "float64" else jnp.float32  # holds `dtype` exactly
    as64 = lambda a: np.asarray(a.astype(wide), np.float64)  # noqa: E731
    with jax.enable_x64(dtype == "float64"):
        norm = _norm(kind, jnp.dtype(dtype))
        x = jnp.asarray(_rows(dtype, np.random.default_rng(0)), jnp.dtype(dtype))
        got = norm_rows(norm, x)
        assert got.dtype == jnp.dtype(dtype)
        got, x = as64(got), as64(x)
        bias = as64(norm.bias) if kind == "layer" else 0.0
        expected = _reference(x, as64(norm.weight), bias, kind == "layer")
    assert np.isfinite(expected).all()
    err = np.abs(got - expected).max(-1) / np.abs(expected).max(-1)
    err = np.where(np.isnan(err), np.inf, err)
    worst = int(np.argmax(err))
    assert err[worst] <= TOLERANCE[dtype], (
        f"{kind} {dtype}: the row of max |x| {np.abs(x[worst]).max():.3g} has rel. error "
        f"{err[worst]:.3g} (tolerance {TOLERANCE[dtype]:g}); output {got[worst, :3]}, "
        f"expected {expected[worst, :3]}; {int((err > TOLERANCE[dtype]).sum())} of "
        f"{len(err)} rows fail"
    )


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_norm_gradients_finite_over_the_range(kind):
    """The branch not taken (plain or scaled statistic) gives no inf or NaN gradient."""
    norm = _norm(kind, jnp.float32)
    x = jnp.asarray(_rows("float32", np.random.default_rng(2)), jnp.float32)
    grads = jax.vmap(jax.grad(lambda v: jnp.sum(norm_rows(norm, v[None]) ** 2)))(x)
    assert np.isfinite(np.asarray(grads)).all()


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_huge_embedding_row_gives_the_float64_logits(kind):
    """The symptom the issue measured. A token whose embedding row is +-1e38 keeps that
    residual stream through the blocks (their outputs are O(1)), and a norm does not see
    its input's scale, so its logits are `norm(signs) @ head`, computed here in float64."""
    model = eqrope.RotaryDecoder(8, 64, 4, 1, 8, norm=kind, key=jax.random.PRNGKey(0))
    signs = np.where(np.arange(64) % 3 == 0, -1.0, 1.0)
    u = signs - signs.mean() if kind == "layer" else signs
    w = np.asarray(model.final_norm.weight, np.float64)
    b = np.asarray(model.final_norm.bias, np.float64) if kind == "layer" else 0.0
    expected = (u / np.sqrt(np.mean(u * u)) * w + b) @ np.asarray(model.head, np.float64)
    for mag in (1e30, 1e38, 3e38):
        row = jnp.asarray(signs * mag, jnp.float32)
        token = eqx.tree_at(lambda m: m.embed, model, model.embed.at[0].set(row))
        got = np.asarray(token(jnp.array([0])))[0]
        atol = 1e-5 * np.abs(expected).max()
        np.testing.assert_allclose(got, expected, rtol=0, atol=atol, err_msg=f"+-{mag:g}")


def _reference_vjp(x, weight, g, layer):
    """The gradient of `sum(g * norm(x))` in float64, per row, from the closed form: with
    `u` the row (centred for LayerNorm) and `r = sqrt(mean(u^2) + eps)`, `dL/du = w g / r
    - u sum(u w g) / (n r^3)`, less its mean for LayerNorm (`du/dx = I - 1/n`). Computed on
    `y = x / a` (`a` the power of two at the row's largest |entry|), where nothing
    overflows: the gradient at `x` is the one at `y` with `eps / a^2` for `eps`, over `a`."""
    a = 2.0 ** np.frexp(np.abs(x).max(-1, keepdims=True))[1]
    u = x / a
    u = u - u.mean(-1, keepdims=True) if layer else u
    r = np.sqrt(np.mean(u * u, -1, keepdims=True) + EPS / a / a)  # a**2 overflows past 1e154
    du = weight * g / r - u * np.sum(u * weight * g, -1, keepdims=True) / (x.shape[-1] * r**3)
    return (du - du.mean(-1, keepdims=True) if layer else du) / a


# Row maxima for the gradients, across each dtype's switch to the scaled statistic (a mean
# square of 2^80 in float32, rows of ~1e12; 2^672 in float64, ~1e101) and the plain one's
# overflow (~1e19; ~1e154). rsqrt's derivative at the plain statistic used to be flushed to
# 0 between the two (a 20% error). Past ~1e35 a float32 gradient is itself subnormal.
GRAD_MAGNITUDES = {"float32": np.logspace(-30, 35, 66), "float64": np.logspace(-100, 300, 81)}


@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_norm_gradients_match_float64_on_both_branches(kind, dtype):
    rng = np.random.default_rng(3)
    u = rng.standard_normal((2, D))
    u[1] += 1.5
    u /= np.abs(u).max(-1, keepdims=True)
    x = (u[None] * GRAD_MAGNITUDES[dtype][:, None, None]).reshape(-1, D).astype(dtype)
    g = rng.standard_normal(x.shape).astype(dtype)
    with jax.enable_x64(dtype == "float64"):
        norm = _norm(kind, jnp.dtype(dtype))
        _, vjp = jax.vjp(lambda v: norm_rows(norm, v), jnp.asarray(x))
        got = np.asarray(vjp(jnp.asarray(g))[0], np.float64)
        weight = np.asarray(norm.weight, np.float64)
    expected = _reference_vjp(x.astype(np.float64), weight, g.astype(np.float64), kind == "layer")
    err = np.abs(got - expected).max(-1) / np.abs(expected).max(-1)
    worst = int(np.argmax(err))
    assert err[worst] <= TOLERANCE[dtype], (
        f"{kind} {dtype}: the row of max |x| {np.abs(x[worst]).max():.3g} has rel. error "
        f"{err[worst]:.3g} (tolerance {TOLERANCE[dtype]:g})"
    )
