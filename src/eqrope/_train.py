"""Training: the next-token loss and an optax step."""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Bool, Float, Int, PyTree

from ._checks import as_int_array, check_int, check_vocab


def cross_entropy(
    model,
    ids: Int[Array, "batch seq"],
    targets: Int[Array, "batch seq"],
    mask: Bool[Array, "batch seq"] | None = None,
    *,
    ignore_id: int | None = -100,
) -> Float[Array, ""]:
    """Mean next-token cross-entropy of `model` over the kept positions.

    **Arguments:**

    - `model`: called as `jax.vmap(model)(ids)`, giving logits `(batch, seq, vocab)`.
    - `ids`: the input token ids.
    - `targets`: `targets[b, t]` is the token that should follow `ids[b, :t+1]`.
    - `mask`: `False` (or 0) leaves a position out; `None` keeps every position.
    - `ignore_id`: a target equal to it leaves its position out, as `mask=False` does
      (`-100`, the convention of transformers and PyTorch, by default; `None`: none).

    **Returns:** the mean over the positions kept by both `mask` and `ignore_id`; 0 if
    none is kept. The log-softmax runs in float32.

    Any other target outside `[0, vocab)` raises, also under `jit` (`eqx.error_if`):
    JAX's gather would otherwise return NaN, or the loss of another token.
    """
    ignore_id = check_int(ignore_id, "ignore_id", none=True)
    targets = as_int_array(targets, "targets", ndim=2)
    logits = jax.vmap(model)(ids).astype(jnp.float32)
    if targets.shape != logits.shape[:2]:
        raise ValueError(
            f"targets must have the shape of ids {logits.shape[:2]}, got {targets.shape}."
        )
    ignored = jnp.zeros(targets.shape, bool) if ignore_id is None else targets == ignore_id
    try:
        targets = check_vocab(jnp.where(ignored, 0, targets), logits.shape[-1], "targets")
    except ValueError as e:
        raise ValueError(
            f"{e} Leave positions out with mask=False or a target of ignore_id "
            f"(now {ignore_id})."
        ) from None
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    weights = (~ignored).astype(jnp.float32)
    if mask is not None:
        weights = weights * mask.astype(jnp.float32)
    total = jnp.sum(jnp.where(weights != 0, nll * weights, 0.0))
    return total / jnp.maximum(jnp.sum(weights), 1.0)


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
