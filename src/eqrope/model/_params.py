"""Parameter counting."""

import equinox as eqx
import jax


def _is_param(x) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def count_params(model) -> int:
    """The number of array elements in `eqx.filter(model, eqx.is_array)`.

    Abstract arrays (`jax.ShapeDtypeStruct`, from `eqx.filter_eval_shape`) count too, so a
    model's size can be read without building it.
    """
    leaves = jax.tree_util.tree_leaves(eqx.filter(model, _is_param))
    return sum(int(leaf.size) for leaf in leaves)
