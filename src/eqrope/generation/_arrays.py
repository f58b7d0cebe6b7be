"""A model as the arguments of a compiled program: its arrays, beside a hashable structure.

`jax.jit` with the structure static is `eqx.filter_jit` without its per-call tree walks,
which dominate the fixed cost of generating with a small model. Inside the program the
model is rebuilt in its decoding layout (`for_decoding`). What a `generate` call reads
from its model (these two, whether it is being differentiated, its `fixed_rows`) is
kept per model object (`model_facts`).
"""

import weakref
from typing import NamedTuple

import equinox as eqx
import jax

from .._checks import is_concrete
from ..model._matmul import converted_in_step


def split_model(model):
    """`(arrays, structure)` for a compiled program: when every leaf of `model` (any
    pytree) is an array, the flat leaves beside the (hashable) tree structure, skipping
    `eqx.partition`'s tree walks; otherwise `eqx.partition`'s two halves."""
    leaves, treedef = jax.tree.flatten(model)
    if all(isinstance(leaf, jax.Array) for leaf in leaves):
        return leaves, treedef
    return eqx.partition(model, eqx.is_array)


class ModelFacts(NamedTuple):
    """What a `generate` call reads from its model: `split_model`'s `arrays` and
    `structure`, whether every array is `concrete` (not a tracer of `jax.grad`), and the
    model's `fixed_rows` (`None` without the attribute)."""

    arrays: object
    structure: object
    concrete: bool
    fixed_rows: int | None


# id(model) -> (a weak reference to it, its facts); an entry leaves with its model.
_FACTS: dict[int, tuple[weakref.ref, ModelFacts]] = {}


def model_facts(model) -> ModelFacts:
    """The `ModelFacts` of `model`, walked once per `eqx.Module` object.

    A module is immutable, so its facts hold while it lives: a concrete module's are kept
    (by `id`, checked against a weak reference, dropped when the module is collected), and
    each later call skips the tree walks (about 0.07 ms of a 2.5 ms seed-protocol call).
    A model with tracers (under `jax.grad`), or any other object, is walked every call.
    """
    entry = _FACTS.get(id(model))
    if entry is not None and entry[0]() is model:
        return entry[1]
    arrays, structure = split_model(model)
    concrete = all(map(is_concrete, jax.tree.leaves(arrays)))
    facts = ModelFacts(arrays, structure, concrete, getattr(model, "fixed_rows", None))
    if concrete and isinstance(model, eqx.Module):
        key = id(model)

        def forget(ref: weakref.ref) -> None:
            if _FACTS.get(key, (None,))[0] is ref:
                del _FACTS[key]

        try:
            _FACTS[key] = (weakref.ref(model, forget), facts)
        except TypeError:  # a module that takes no weak reference: walked every call
            pass
    return facts


def rebuild(arrays, structure):
    """The model `split_model` split."""
    if isinstance(structure, jax.tree_util.PyTreeDef):
        return jax.tree.unflatten(structure, arrays)
    return eqx.combine(arrays, structure)


def for_decoding(model, cache=None):
    """`model` with one buffer per block (`model.unstacked()`, for a model that has the
    two layouts, such as [`eqrope.RotaryDecoder`][]), and `cache` (if given) with
    per-block buffers to match, called inside a compiled program after the prefill.

    The prefill runs on the model as given: a stacked model's prefill is a scan over its
    blocks, so the program's compile time stays flat in depth there. The decode loop
    then runs on per-block weights and buffers: a stacked model's blocks are sliced once
    per call, before the loop, instead of XLA copying each block's slice before every
    matrix product of every step, a copy of the blocks inside every call; a model held
    unstacked (a float32 one as `from_hf` and `load` return it) costs nothing here.

    A stacked low-precision model on the CPU (as `from_hf` and `load` return it) stays
    stacked: its steps convert each weight to float32 inside the step anyway
    (`eqrope.model._matmul`), so the slice costs nothing more there, and the per-block
    copies would add most of the weights' bytes to the program's peak memory.
    """
    unstacked = getattr(type(model), "unstacked", None)
    if unstacked is None or any(map(converted_in_step, jax.tree.leaves(model))):
        return model if cache is None else (model, cache)
    model = model.unstacked()
    return model if cache is None else (model, cache.split_blocks())
