"""The optimizer state and the compiled optax train step, and the checks that every
train step (this one, the adapters', GRPO's) makes of its optimizer and its state."""

from collections.abc import Callable
from typing import Any, Protocol, TypeVar, final, runtime_checkable

import equinox as eqx
import jax
import optax
from jaxtyping import Array, Float, PyTree

from .._log import compiling, shapes_of
from ._loss import cross_entropy


_Model = TypeVar("_Model")


@runtime_checkable
class TrainStep(Protocol):
    """The step [`eqrope.make_train_step`][] returns: `step(model, opt_state, *batch) ->
    (model, opt_state, loss)`, the model of the type given and the loss a float scalar."""

    def __call__(
        self, model: _Model, opt_state: PyTree, /, *batch: Any
    ) -> tuple[_Model, PyTree, Float[Array, ""]]: ...


@final
class NamedStep:
    """A train step as [`eqrope.make_train_step`][] and
    [`eqrope.make_adapter_train_step`][] return it: calling it calls `fn` (compiled with
    `eqx.filter_jit`), and its repr says what it is and how to call it, not
    `_JitWrapper(...)`."""

    def __init__(self, fn: Callable, made_by: str, call: str, loss_fn: Callable):
        self.fn, self.made_by, self.call, self.loss_fn = fn, made_by, call, loss_fn

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def lower(self, *args, **kwargs):
        """`fn.lower(...)`: the step lowered for these arguments (`.compile()` it)."""
        return self.fn.lower(*args, **kwargs)

    def __repr__(self) -> str:
        loss = getattr(self.loss_fn, "__qualname__", None) or repr(self.loss_fn)
        return f"<{self.made_by}(optimizer, loss_fn={loss}): {self.call}>"


def check_optimizer(optimizer, who: str) -> optax.GradientTransformation:
    """`optimizer` if it has optax's `init` and `update`; else a `TypeError`."""
    if not (callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))):
        raise TypeError(
            f"{who}: optimizer must be an optax.GradientTransformation (with init and update), "
            f"such as optax.adam(1e-3); got {optimizer!r} ({type(optimizer).__name__})."
        )
    return optimizer


def check_loss_fn(loss_fn, who: str) -> Callable:
    """`loss_fn` if it is callable; else a `TypeError`."""
    if not callable(loss_fn):
        raise TypeError(
            f"{who}: loss_fn must be a function loss_fn(model, *batch) -> loss, got {loss_fn!r}."
        )
    return loss_fn


def check_opt_state(optimizer, params, opt_state, *, who: str, init: str, other: str) -> None:
    """Raise a `TypeError` unless `opt_state` has the tree structure of
    `optimizer.init(params)`: the state of another init (`init_optimizer`'s given to a
    step that trains the adapters alone, or the reverse) would otherwise fail deep inside
    optax. Only shapes are traced (`jax.eval_shape`), once per compile of the step; the
    structure alone is compared, so a state mapped by `jax.vmap` passes."""
    with jax.numpy_dtype_promotion("standard"):
        expected = jax.eval_shape(optimizer.init, params)
    if jax.tree.structure(opt_state) != jax.tree.structure(expected):
        raise TypeError(
            f"{who}: opt_state is not this optimizer's state for the arrays it trains (its "
            f"tree structure differs). Make it with {init}(optimizer, model), with the "
            f"optimizer the step was built with; {other}."
        )


FULL_STATE = dict(
    init="eqrope.init_optimizer",
    other="eqrope.init_adapter_optimizer's state holds an adapted model's adapters alone",
)


def init_optimizer(optimizer: optax.GradientTransformation, model) -> PyTree:
    """The optimiser state for the model's floating-point arrays."""
    check_optimizer(optimizer, "eqrope.init_optimizer")
    with jax.numpy_dtype_promotion("standard"):
        return optimizer.init(eqx.filter(model, eqx.is_inexact_array))


def make_train_step(
    optimizer: optax.GradientTransformation,
    loss_fn: Callable = cross_entropy,
) -> TrainStep:
    """A compiled step `(model, opt_state, *batch) -> (model, opt_state, loss)`.

    `loss_fn(model, *batch)` defaults to [`eqrope.cross_entropy`][]. Gradients are taken
    with respect to the model's floating-point arrays, whose optimizer state comes from
    [`eqrope.init_optimizer`][] (another state, such as
    [`eqrope.init_adapter_optimizer`][]'s, raises a `TypeError` naming it). With
    `remat=True` in the config each block is recomputed in the backward pass. The first
    call with new batch shapes compiles (a line at INFO on the `eqrope.training` logger).
    """
    check_optimizer(optimizer, "eqrope.make_train_step")
    check_loss_fn(loss_fn, "eqrope.make_train_step")

    @eqx.filter_jit
    def train_step(model, opt_state, *batch):
        compiling("training", "the train step", shapes_of(batch), "batch shape or dtype")
        params = eqx.filter(model, eqx.is_inexact_array)
        check_opt_state(optimizer, params, opt_state, who="the train step", **FULL_STATE)
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, *batch)
        # optax mixes Python and array scalars (e.g. adam's `b1 ** count`), which JAX's
        # strict dtype promotion refuses; eqrope's own code runs strict.
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = optimizer.update(grads, opt_state, params)
        model = eqx.apply_updates(model, updates)
        return model, opt_state, loss

    return NamedStep(
        train_step, "eqrope.make_train_step",
        "step(model, opt_state, *batch) -> (model, opt_state, loss), compiled once per batch "
        "shape and dtype", loss_fn,
    )  # fmt: skip
