"""The test session checks jaxtyping annotations at run time (pyproject's addopts)."""

import jax.numpy as jnp
import jaxtyping
import pytest

import eqrope


def test_shape_annotations_are_enforced():
    x = jnp.zeros((3, 2, 4), jnp.float32)  # seq = 3
    positions = jnp.arange(5, dtype=jnp.int32)  # seq = 5: inconsistent
    inv_freq = eqrope.rope_inv_freq(4)
    with pytest.raises(jaxtyping.TypeCheckError, match="seq"):
        eqrope.apply_rope(x, positions, inv_freq)
