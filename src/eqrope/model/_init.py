"""Weight initialisation shared by the layers."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray


def uniform_weight(key: PRNGKeyArray, fan_in: int, shape: tuple[int, ...], dtype) -> Array:
    """`U(-1/sqrt(fan_in), 1/sqrt(fan_in))`, the default of `eqx.nn.Linear` and PyTorch."""
    lim = 1.0 / fan_in**0.5
    return jax.random.uniform(key, shape, jnp.float32, -lim, lim).astype(dtype)
