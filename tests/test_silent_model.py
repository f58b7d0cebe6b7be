"""Models that used to build or run without complaint and give the wrong thing: a float64
model without `jax_enable_x64`, and norms whose statistic overflowed in float32."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqrope
from _models import random_model


SIZES = (17, 16, 2, 2, 8)


# -- float64 needs jax_enable_x64 --------------------------------------------------------


def test_float64_without_x64_is_refused():
    with jax.enable_x64(False):
        with pytest.raises(ValueError, match=r"jax_enable_x64.*jax\.config\.update"):
            eqrope.DecoderConfig(*SIZES, dtype="float64")
        with pytest.raises(ValueError, match="jax_enable_x64"):
            eqrope.RotaryDecoder(*SIZES, dtype=jnp.float64, key=jax.random.PRNGKey(0))
        with pytest.raises(ValueError, match="jax_enable_x64"):
            eqrope.DecoderConfig.from_dict(
                {**eqrope.DecoderConfig(*SIZES).to_dict(), "dtype": "float64"}
            )


def test_float64_with_x64_builds_runs_and_saves(tmp_path):
    with jax.enable_x64(True):
        model = eqrope.RotaryDecoder(*SIZES, dtype=jnp.float64, key=jax.random.PRNGKey(0))
        assert model.embed.dtype == jnp.float64
        assert model(jnp.arange(5)).dtype == jnp.float64
        eqrope.save(tmp_path, model)
        assert eqrope.load(tmp_path).embed.dtype == jnp.float64
    with jax.enable_x64(False):
        with pytest.raises(ValueError, match="config.json is invalid: .*jax_enable_x64"):
            eqrope.load(tmp_path)


# -- norms that cannot overflow ----------------------------------------------------------


def _scaled(model, factor):
    return jax.tree.map(lambda w: w * factor if eqx.is_inexact_array(w) else w, model)


def _as_float64(model):
    """The same model with float64 arrays and config (call under `jax.enable_x64`)."""
    kwargs = {**model.config.options(), "dtype": "float64"}
    skeleton = eqx.filter_eval_shape(
        lambda: eqrope.RotaryDecoder(*SIZES, **kwargs, key=jax.random.PRNGKey(0))
    )
    leaves = [jnp.asarray(np.asarray(a), jnp.float64) for a in jax.tree.leaves(model)]
    return jax.tree.unflatten(jax.tree.structure(skeleton), leaves)


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_huge_weights_give_the_float64_logits(norm):
    """Weights x 1e4: the mean of squares of the residual stream (~1e21) overflows float32,
    which used to make every logit exactly 0.0."""
    model = _scaled(random_model(0, *SIZES, norm=norm), 1e4)
    ids = jnp.asarray([3, 1, 4, 1, 5, 9, 2, 6], jnp.int32)
    got = np.asarray(model(ids))
    assert np.isfinite(got).all() and np.abs(got).max() > 1e6
    with jax.enable_x64(True):
        expected = np.asarray(_as_float64(model)(ids))
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_norm_of_extreme_vectors(norm):
    """Rows of size 1, 1e30, 1e-30 and 0 against x / sqrt(mean(x^2) + eps) in float64
    (x centred for LayerNorm; the weights are ones and the bias zeros)."""
    from eqrope.model._norm import make_norm, norm_rows

    layer = make_norm(norm, 8, 1e-5, jnp.float32)
    row = np.random.default_rng(0).standard_normal(8).astype(np.float32)
    rows = np.stack([row, row * 1e30, row * 1e-30, np.zeros(8, np.float32)])
    out = np.asarray(norm_rows(layer, jnp.asarray(rows)))
    x = rows.astype(np.float64)
    if norm == "layer":
        x = x - x.mean(-1, keepdims=True)
    expected = x / np.sqrt(np.mean(x**2, -1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=0)
    # Gradients stay finite, also at zero and at huge inputs.
    grads = jax.vmap(jax.grad(lambda v: jnp.sum(norm_rows(layer, v[None]) ** 2)))(jnp.asarray(rows))
    assert np.isfinite(np.asarray(grads)).all()


def test_bfloat16_norm_keeps_its_dtype():
    from eqrope.model._norm import make_norm, norm_rows

    layer = make_norm("rms", 8, 1e-5, jnp.bfloat16)
    small = np.random.default_rng(1).standard_normal((3, 8))
    out = norm_rows(layer, jnp.asarray(small * 1e30, jnp.bfloat16))
    assert out.dtype == jnp.bfloat16
    expected = small / np.sqrt(np.mean(small**2, axis=-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(out, np.float32), expected, rtol=2e-2, atol=2e-2)
