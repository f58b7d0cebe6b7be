"""Parameter counting."""

import equinox as eqx
import jax


def count_params(model) -> int:
    """The number of array elements in `eqx.filter(model, eqx.is_array)`."""
    leaves = jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array))
    return sum(int(leaf.size) for leaf in leaves)
