"""A model as the arguments of a compiled program: its arrays, beside a hashable structure.

`jax.jit` with the structure static is `eqx.filter_jit` without its per-call tree walks,
which dominate the fixed cost of generating with a small model. Inside the program the
model is rebuilt in its decoding layout (`for_decoding`).
"""

import equinox as eqx
import jax

from ..model._matmul import converted_in_step


def split_model(model):
    """`(arrays, structure)` for a compiled program: when every leaf of `model` (any
    pytree) is an array, the flat leaves beside the (hashable) tree structure, skipping
    `eqx.partition`'s tree walks; otherwise `eqx.partition`'s two halves."""
    leaves, treedef = jax.tree.flatten(model)
    if all(isinstance(leaf, jax.Array) for leaf in leaves):
        return leaves, treedef
    return eqx.partition(model, eqx.is_array)


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
