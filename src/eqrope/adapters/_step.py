"""Training only the adapters: their optimizer state and the compiled train step.

The adapted model is split with `eqx.partition` into the adapters' `A` and `B` arrays and
everything else (`_lora.adapter_spec`); gradients are taken, and the optimizer state is
held, for the adapters alone. The base arrays pass through the step as constants, so no
gradient of a base weight is ever computed, and they come out bitwise unchanged.
"""

from collections.abc import Callable
from typing import Any, Protocol, TypeVar, runtime_checkable

import equinox as eqx
import jax
import optax
from jaxtyping import Array, Float, PRNGKeyArray, PyTree

from .._log import compiling, shapes_of
from ..training._loss import cross_entropy
from ..training._step import NamedStep, check_loss_fn, check_opt_state, check_optimizer
from ._lora import check_adapted, split_adapters
from ._weight import is_lora, lora_weights


_Model = TypeVar("_Model")


@runtime_checkable
class AdapterTrainStep(Protocol):
    """The step [`eqrope.make_adapter_train_step`][] returns: `step(model, opt_state,
    *batch, key=None) -> (model, opt_state, loss)`, the model of the type given (the
    adapted model, base arrays unchanged) and the loss a float scalar."""

    def __call__(
        self, model: _Model, opt_state: PyTree, /, *batch: Any, key: PRNGKeyArray | None = None
    ) -> tuple[_Model, PyTree, Float[Array, ""]]: ...


def init_adapter_optimizer(optimizer: optax.GradientTransformation, model) -> PyTree:
    """The optimizer state of `model`'s adapters alone (the `A` and `B` arrays of each
    [`eqrope.LoraWeight`][]); the base has none.

    For [`eqrope.make_adapter_train_step`][]. Under `jax.vmap` (or `eqx.filter_vmap`
    with [`eqrope.adapter_axes`][]) over stacked adapters it gives one state per adapter,
    so that one optimizer with traced hyperparameters
    (`optax.inject_hyperparams(optax.adam)(learning_rate=lr)`) sweeps them.
    """
    check_optimizer(optimizer, "eqrope.init_adapter_optimizer")
    check_adapted(model, "eqrope.init_adapter_optimizer")
    adapters, _ = split_adapters(model)
    with jax.numpy_dtype_promotion("standard"):
        return optimizer.init(adapters)


ADAPTER_STATE = dict(
    init="eqrope.init_adapter_optimizer",
    other="eqrope.init_optimizer's state holds every weight, for eqrope.make_train_step",
)


def make_adapter_train_step(
    optimizer: optax.GradientTransformation,
    loss_fn: Callable = cross_entropy,
) -> AdapterTrainStep:
    """A step `(model, opt_state, *batch, key=None) -> (model, opt_state, loss)` that
    trains only the adapters of a model from [`eqrope.lora`][], in one compiled program.

    **Arguments:**

    - `optimizer`: an optax transformation; its state comes from
      [`eqrope.init_adapter_optimizer`][] (another state, such as
      [`eqrope.init_optimizer`][]'s for every weight, raises a `TypeError` naming it).
    - `loss_fn`: `loss_fn(model, *batch)`, by default [`eqrope.cross_entropy`][].

    The step differentiates `loss_fn` with respect to the adapters' `A` and `B` arrays
    only; the base arrays are constants of the program (no gradient, no optimizer state)
    and the returned model holds the very base arrays it was given. `remat=True` in the config recomputes each block
    in the backward pass, as for [`eqrope.make_train_step`][]; a model placed with
    [`eqrope.adapter_shardings`][] keeps its placement.

    `key` draws the adapters' dropout (`dropout > 0` in `eqrope.lora`), a new mask for
    every block, target and step; it is required then, and unused otherwise.

    `eqx.filter_vmap(step, in_axes=(eqrope.adapter_axes(many), 0, None, None))` over
    adapters stacked by [`eqrope.stack_adapters`][] trains them all in one program.
    """
    check_optimizer(optimizer, "eqrope.make_adapter_train_step")
    check_loss_fn(loss_fn, "eqrope.make_adapter_train_step")

    @eqx.filter_jit
    def update(adapters, rest, opt_state, *batch, key, dropout):
        compiling("adapters", "the adapter train step", shapes_of(batch), "batch shape or dtype")
        check_opt_state(optimizer, adapters, opt_state, who="the adapter train step", **ADAPTER_STATE)

        def loss_of(adapters, *batch):
            model = eqx.combine(adapters, rest)
            return loss_fn(with_dropout_keys(model, key) if dropout else model, *batch)

        loss, grads = eqx.filter_value_and_grad(loss_of)(adapters, *batch)
        # optax mixes Python and array scalars, which JAX's strict promotion refuses.
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = optimizer.update(grads, opt_state, adapters)
        return eqx.apply_updates(adapters, updates), opt_state, loss

    def adapter_train_step(model, opt_state, *batch, key: PRNGKeyArray | None = None):
        check_adapted(model, "the adapter train step")
        dropout = any(p is not None and p.dropout > 0 for w in lora_weights(model) for p in w.parts)
        if dropout and key is None:
            raise ValueError(
                "the adapters have dropout > 0; pass key=jax.random.key(step) to the train "
                "step (a new key each step), or build them with dropout=0.0."
            )
        # The compiled update returns the adapters alone: the base arrays go back into
        # the model here, the very arrays given (no copy of the base out of the program).
        adapters, rest = split_adapters(model)
        adapters, opt_state, loss = update(adapters, rest, opt_state, *batch, key=key, dropout=dropout)
        return eqx.combine(adapters, rest), opt_state, loss

    return NamedStep(
        adapter_train_step, "eqrope.make_adapter_train_step",
        "step(model, opt_state, *batch, key=None) -> (model, opt_state, loss), training the "
        "adapters alone, compiled once per batch shape and dtype", loss_fn,
    )  # fmt: skip


def with_dropout_keys(model, key: PRNGKeyArray):
    """`model` with a dropout key in each [`eqrope.LoraWeight`][]: one per weight and
    block (a stacked model's keys have a leading `blocks` axis)."""
    n_blocks = model.config.n_blocks if model.layout == "stacked" else None
    weights = lora_weights(model)
    keys = iter(jax.random.split(key, len(weights)))

    def give(w):
        if not is_lora(w):
            return w
        k = next(keys)
        return eqx.tree_at(
            lambda x: x.key, w, k if n_blocks is None else jax.random.split(k, n_blocks),
            is_leaf=lambda x: x is None,
        )

    return jax.tree.map(give, model, is_leaf=is_lora)

