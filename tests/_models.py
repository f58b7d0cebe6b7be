"""Models for the tests, built without compiling anything."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import eqrope


def random_model(seed, *args, **kwargs):
    """A `RotaryDecoder` whose arrays are drawn with NumPy: no compilation to build it.

    The same seed and sizes give the same arrays whatever the static options (`remat`).
    """
    skeleton = eqx.filter_eval_shape(
        lambda: eqrope.RotaryDecoder(*args, **kwargs, key=jax.random.PRNGKey(0))
    )
    rng = np.random.default_rng(seed)

    def fill(path, leaf):
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            return leaf
        name = jax.tree_util.keystr(path).split(".")[-1]
        if name in ("embed", "pos_embed"):
            value = rng.normal(size=leaf.shape)
        elif name == "weight":  # a norm's scale
            value = 1.0 + 0.2 * rng.normal(size=leaf.shape)
        elif name in ("bias", "head_bias", "bqkv", "bo") or name.startswith("b_"):
            value = 0.2 * rng.normal(size=leaf.shape)
        else:  # a matrix (in, out), maybe with a leading blocks axis
            value = rng.normal(size=leaf.shape) / math.sqrt(leaf.shape[-2])
        return jnp.asarray(value, leaf.dtype)

    return jax.tree_util.tree_map_with_path(fill, skeleton)
