"""Many adapters of one base in one program: stacked for `jax.vmap`, or chosen per row.

- [`eqrope.stack_adapters`][] puts k adapters' `A` and `B` arrays on an `adapters`
  axis (after `blocks` where the blocks are stacked) over one shared base. [`eqrope.adapter_axes`][] is the `in_axes` that
  maps that axis, so `eqx.filter_vmap` of a train step trains the k adapters at once
  (a sweep of learning rates, of seeds, of data) in one compiled program.
- [`eqrope.select_adapters`][] assigns one of the k adapters to each row of a batch; the
  result goes to [`eqrope.generate`][] as it is: one prefill and one decode program for
  the batch, the base's matrix products shared by every row, and each row's low-rank
  update gathered from its adapter (`_weight._per_row`). The assignment is an array, so a
  new one compiles nothing.
"""

from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import ArrayLike

from .._checks import as_int_array, as_scalar, is_concrete, is_int
from .._custom_types import IntLike
from ..model._decoder import RotaryDecoder
from ._lora import check_adapted
from ._weight import LowRank, is_lora, lora_weights


def _is_part(x) -> bool:
    return isinstance(x, LowRank)


def stack_adapters(models: Sequence[RotaryDecoder]) -> RotaryDecoder:
    """k adapted models of one base as one model whose adapters carry an `adapters` axis
    of length k (the base is held once): the first axis of each `A` and `B`, or the
    second, after `blocks`, in the stacked layout.

    **Arguments:** `models`, adapted models ([`eqrope.lora`][], [`eqrope.from_peft`][],
    [`eqrope.load_adapter`][]) with one base (config, layout and arrays) and the same
    targets. Adapters of different ranks or scales are padded with zeros to the largest
    rank and their scale folded into `B` (each update unchanged).

    **Returns:** a `RotaryDecoder` for `eqx.filter_vmap(..., in_axes=eqrope.adapter_axes(it))`,
    [`eqrope.select_adapters`][] or [`eqrope.take_adapter`][]; called directly, it raises.
    """
    models = list(models) if isinstance(models, (list, tuple)) else None
    if not models:
        raise TypeError("stack_adapters takes a non-empty list of adapted models.")
    for i, m in enumerate(models):
        check_adapted(m, f"stack_adapters: models[{i}]")
        if any(w.rows is not None for w in lora_weights(m)) or _stacked(m):
            raise ValueError(f"stack_adapters: models[{i}] already holds several adapters.")
    first = models[0]
    for i, m in enumerate(models[1:], 1):
        if m.config != first.config or m.layout != first.layout:
            raise ValueError(
                f"stack_adapters: models[{i}] has another config or layout than models[0]; "
                "stack adapters of one base."
            )
        if jax.tree.structure(m, is_leaf=_is_part) != jax.tree.structure(first, is_leaf=_is_part):
            raise ValueError(
                f"stack_adapters: models[{i}] adapts other projections than models[0]; "
                "stacked adapters need the same targets."
            )

    axis = _axis(first)

    def combine(*nodes):
        if _is_part(nodes[0]):
            return _stack_parts(nodes, axis)
        if not all(n is nodes[0] or np.array_equal(n, nodes[0]) for n in nodes[1:]):
            raise ValueError(
                "stack_adapters: the models have different base arrays; stack adapters "
                "of one base model."
            )
        return nodes[0]

    return jax.tree.map(combine, *models, is_leaf=_is_part)


def _stack_parts(parts: Sequence[LowRank], axis: int) -> LowRank:
    same = {(p.rank, p.alpha, p.rslora) for p in parts}
    if len({p.dropout for p in parts}) > 1:
        raise ValueError("stack_adapters: the adapters have different dropout rates.")
    if len(same) == 1:
        a, b = jnp.stack([p.a for p in parts], axis), jnp.stack([p.b for p in parts], axis)
        return LowRank(a, b, alpha=parts[0].alpha, rslora=parts[0].rslora, dropout=parts[0].dropout)
    rank = max(p.rank for p in parts)
    pad = lambda x, axis: jnp.pad(x, [(0, rank - x.shape[axis]) if d == x.ndim + axis else (0, 0) for d in range(x.ndim)])  # noqa: E731
    a = jnp.stack([pad(p.a, -1) for p in parts], axis)
    b = jnp.stack([pad(p.b * jnp.asarray(p.scale, p.b.dtype), -2) for p in parts], axis)
    # alpha = rank without rsLoRA is a scale of one: the scales are in `b`.
    return LowRank(a, b, alpha=float(rank), rslora=False, dropout=parts[0].dropout)


def _parts(model) -> list[LowRank]:
    return [x for x in jax.tree.leaves(model, is_leaf=_is_part) if _is_part(x)]


def _axis(model) -> int:
    """Where the `adapters` axis of stacked adapters is: after the `blocks` axis of a
    stacked model (so that `unstacked` and the scan over blocks slice blocks), else first."""
    return 1 if model.layout == "stacked" else 0


def _stacked(model) -> bool:
    """Whether `model`'s adapters carry a leading `adapters` axis (`stack_adapters`)."""
    blocks = model.layout == "stacked"
    return any(p.a.ndim > 2 + blocks for p in _parts(model))


def _count(model, who: str) -> int:
    check_adapted(model, who)
    if not _stacked(model) or any(w.rows is not None for w in lora_weights(model)):
        raise ValueError(f"{who} takes a model from eqrope.stack_adapters.")
    return _parts(model)[0].a.shape[_axis(model)]


def adapter_axes(model: RotaryDecoder):
    """The `in_axes` (and `out_axes`) of `eqx.filter_vmap` that maps the `adapters` axis
    of a model from [`eqrope.stack_adapters`][]: its `adapters` axis (1 in the stacked
    layout, else 0) on each adapter's `A` and `B`,
    `None` on everything else (the base is shared)."""
    _count(model, "adapter_axes")
    axis = _axis(model)
    axes = lambda x: jax.tree.map(lambda _: axis, x) if _is_part(x) else None  # noqa: E731
    return jax.tree.map(axes, model, is_leaf=_is_part)


def take_adapter(model: RotaryDecoder, index: IntLike) -> RotaryDecoder:
    """Adapter `index` of a model from [`eqrope.stack_adapters`][], as one adapted model."""
    k = _count(model, "take_adapter")
    if not is_int(index) or not 0 <= int(as_scalar(index)) < k:
        raise ValueError(f"take_adapter: index must be an int in [0, {k}), got {index!r}.")
    index = int(as_scalar(index))
    axis = _axis(model)
    take = lambda x: jax.tree.map(lambda a: jnp.take(a, index, axis), x) if _is_part(x) else x  # noqa: E731
    return jax.tree.map(take, model, is_leaf=_is_part)


def select_adapters(model: RotaryDecoder, adapter_ids: ArrayLike | Sequence) -> RotaryDecoder:
    """A model for a batch whose row `i` uses adapter `adapter_ids[i]` of a model from
    [`eqrope.stack_adapters`][].

    `eqrope.generate(eqrope.select_adapters(many, ids), prompts, ...)` runs the batch in
    one prefill and one compiled decode loop; row `i` equals
    `eqrope.generate(eqrope.take_adapter(many, ids[i]), prompts[i], ...)`. The ids are an
    array of the model, so a new assignment of adapters to rows compiles nothing (a new
    batch size does, as always). The model runs under `jax.vmap` over exactly
    `len(adapter_ids)` rows, as `generate` runs it; `num_samples` (whose prefill and
    decode have different numbers of rows) is refused: repeat the prompts instead.

    Raises `ValueError` for ids outside `[0, k)` or not 1-D.
    """
    k = _count(model, "select_adapters")
    ids = as_int_array(adapter_ids, "adapter_ids", ndim=1)
    if ids.shape[0] == 0:
        raise ValueError("adapter_ids is empty; pass one adapter id per row of the batch.")
    if is_concrete(ids):
        bad = (ids < 0) | (ids >= k)
        if bad.any():
            raise ValueError(
                f"adapter_ids holds {np.asarray(ids)[bad][:5].tolist()}, outside [0, {k}): "
                f"the model stacks {k} adapters."
            )
    else:
        ids = eqx.error_if(ids, (ids < 0) | (ids >= k), f"adapter_ids outside [0, {k}).")
    ids = jnp.asarray(ids, jnp.int32)
    n_blocks = model.config.n_blocks if model.layout == "stacked" else None

    def choose(w):
        if not is_lora(w):
            return w
        # Stacked blocks: every array leads with `blocks`, the ids too.
        rows = ids if n_blocks is None else jnp.broadcast_to(ids, (n_blocks, ids.shape[0]))
        return eqx.tree_at(lambda x: x.rows, w, rows, is_leaf=lambda x: x is None)

    return jax.tree.map(choose, model, is_leaf=is_lora)
