"""The optimizer state and the compiled optax train step."""

from collections.abc import Callable

import equinox as eqx
import jax
import optax
from jaxtyping import PyTree

from ._loss import cross_entropy


def init_optimizer(optimizer: optax.GradientTransformation, model) -> PyTree:
    """The optimiser state for the model's floating-point arrays."""
    with jax.numpy_dtype_promotion("standard"):
        return optimizer.init(eqx.filter(model, eqx.is_inexact_array))


def make_train_step(
    optimizer: optax.GradientTransformation,
    loss_fn: Callable = cross_entropy,
) -> Callable:
    """A compiled step `(model, opt_state, *batch) -> (model, opt_state, loss)`.

    `loss_fn(model, *batch)` defaults to [`eqrope.cross_entropy`][]. Gradients are taken
    with respect to the model's floating-point arrays. With `remat=True` in the config each
    block is recomputed in the backward pass.
    """

    @eqx.filter_jit
    def train_step(model, opt_state, *batch):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, *batch)
        params = eqx.filter(model, eqx.is_inexact_array)
        # optax mixes Python and array scalars (e.g. adam's `b1 ** count`), which JAX's
        # strict dtype promotion refuses; eqrope's own code runs strict.
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = optimizer.update(grads, opt_state, params)
        model = eqx.apply_updates(model, updates)
        return model, opt_state, loss

    return train_step
