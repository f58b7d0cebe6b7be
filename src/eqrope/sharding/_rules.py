"""Placing models, optimiser states and caches on a device mesh, by declarative rules.

eqrope does no communication of its own. Arrays are placed with
`jax.sharding.NamedSharding` on a mesh with axes `"data"` and `"model"`; the unchanged
model code then runs under `jax.jit`, and XLA's SPMD partitioner splits every operation
and inserts the collectives (all-reduce, all-gather, ...) that the placement implies.
[`eqrope.testing.hlo_collectives`][] lists them from the compiled program.

A rule maps one *logical* axis of the decoder (`vocab`, `d_model`, `heads`, `kv_heads`,
`d_ff`, `batch`, `max_len`) to a mesh axis or to `None` (replicated). Every array of the
decoder names the logical axis of each of its dimensions (the table in `_weights.py`), so
one rule places every array that has that axis. The mesh itself is built and checked in
`_mesh.py`.
"""

import dataclasses

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from ..model._cache import KVCache
from ..model._decoder import RotaryDecoder
from ._mesh import MeshAxes, axis_names, check_mesh, mesh_size
from ..weights._table import BY_PATH, axis_counts


_RULE_AXES = ("batch", "vocab", "d_model", "heads", "kv_heads", "d_ff", "max_len")


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Which mesh axis each logical axis of the decoder is split over.

    The defaults are Megatron-style tensor parallelism on `"model"` with data parallelism
    on `"data"`: the batch is split over `"data"`; attention heads, key/value heads, the
    feed-forward width and the vocabulary over `"model"`; `d_model` and the cache rows
    (`max_len`) are replicated. Axes not listed here (`blocks`, `head_dim`) are always
    replicated.

    Each field is a mesh axis name, a tuple of names (split over their product), or
    `None` (replicated).

    **Fused dimensions.** `wqkv` has columns `[q heads | k heads | v heads]` and
    `w_gate_up` has columns `[gate | up]`. A mesh shards a dimension in contiguous
    blocks, so no sharding of these columns can give each device its own q, k and v heads
    (or its own gate and up columns) together. eqrope shards the fused columns on the
    mesh axis of their parts (`heads` and `kv_heads` must then map to the same axis;
    otherwise the fused columns are replicated) and requires each part to split into
    whole heads (whole columns for `d_ff`). The weights then take `1/n` of the memory per
    device, and after the projection XLA moves head-sized blocks of activations to where
    attention needs them (the collective-permutes and all-to-alls in the compiled
    program). The result is the same as on one device; only the traffic differs.
    """

    batch: MeshAxes = "data"
    vocab: MeshAxes = "model"
    d_model: MeshAxes = None
    heads: MeshAxes = "model"
    kv_heads: MeshAxes = "model"
    d_ff: MeshAxes = "model"
    max_len: MeshAxes = None

    def __post_init__(self):
        for name in _RULE_AXES:
            value = getattr(self, name)
            if value == () or not all(isinstance(n, str) for n in axis_names(value)):
                raise TypeError(
                    f"ShardingRules.{name} must be a mesh axis name, a tuple of names or "
                    f"None, got {value!r}."
                )

    def axis(self, logical: str) -> MeshAxes:
        """The mesh axes of a logical axis; `None` for the always-replicated ones."""
        return getattr(self, logical) if logical in _RULE_AXES else None


# The arrays of a `KVCache` (one sequence; a batched cache adds a leading `batch`).
_ROWS = ("blocks", "kv_heads", "max_len", "head_dim")
_CACHE_AXES = {
    "keys": _ROWS,
    "values": _ROWS,
    "key_scales": _ROWS[:-1],
    "value_scales": _ROWS[:-1],
    "filled": (),
}


def shardings(tree, mesh: Mesh | AbstractMesh, rules: ShardingRules | None = None):
    """The `NamedSharding` of every array of `tree`, as a pytree of the same structure.

    Arrays of a [`eqrope.RotaryDecoder`][] (also the copies an optax state holds, which
    have the model's structure) and of a [`eqrope.KVCache`][] are sharded by `rules`;
    every other array is replicated. Non-array leaves map to `None`. `tree` may hold
    `jax.ShapeDtypeStruct`s (from `jax.eval_shape`) and `mesh` may be an `AbstractMesh`,
    to plan a placement (or `jax.jit` `out_shardings`) without devices or arrays.

    Raises `ValueError` naming the logical dimension and the mesh axis when a rule does
    not split a dimension evenly (or would split heads), and `TypeError` for a mesh
    without `AxisType.Auto` axes.
    """
    rules = ShardingRules() if rules is None else rules
    _check_mesh(mesh, rules)

    def place(x, axes, counts, where):
        return NamedSharding(mesh, _spec(x, axes, counts, where, mesh, rules))

    return _map_arrays(tree, place)


def shard(tree, mesh: Mesh, rules: ShardingRules | None = None):
    """Place a model, an optimiser state or a cache (or a pytree of them) on `mesh`.

    **Arguments:**

    - `tree`: a [`eqrope.RotaryDecoder`][], an optax state (its moments have the model's
      structure and take the model's sharding; counters are replicated), a
      [`eqrope.KVCache`][] (batched or not), or any pytree holding these.
    - `mesh`: a mesh with the axes the rules name, such as [`eqrope.make_mesh`][].
    - `rules`: a [`eqrope.ShardingRules`][]; `None` means the defaults.

    **Returns:** the same pytree with its arrays placed by `jax.device_put`; see
    [`eqrope.shardings`][] for what goes where and for the errors.

    For the batch of a train step, use [`eqrope.shard_batch`][].
    """
    placements = shardings(tree, mesh, rules)
    return jax.tree.map(
        lambda x, s: x if s is None else jax.device_put(x, s),
        tree,
        placements,
        is_leaf=lambda x: x is None,
    )


def shard_batch(tree, mesh: Mesh, rules: ShardingRules | None = None):
    """Place every array of `tree` with its leading axis on the `batch` rule's mesh axis.

    For the `(batch, seq)` token ids and targets of a train step. Raises `ValueError` if
    the mesh axis does not divide the batch.
    """
    rules = ShardingRules() if rules is None else rules
    _check_mesh(mesh, rules)

    def place(x):
        if not _is_array(x):
            return x
        if np.ndim(x) == 0:
            raise ValueError("shard_batch takes arrays with a leading batch axis, got a scalar.")
        axes = ("batch",) + (None,) * (np.ndim(x) - 1)
        spec = _spec(x, axes, {"batch": np.shape(x)[0]}, "the batch", mesh, rules)
        return jax.device_put(x, NamedSharding(mesh, spec))

    return jax.tree.map(place, tree)


def constrain(tree, mesh: Mesh | None, rules: ShardingRules | None = None):
    """Inside `jax.jit`: pin the arrays of `tree` to the sharding [`eqrope.shard`][] gives.

    `jax.lax.with_sharding_constraint` with [`eqrope.shardings`][]; so a cache built
    inside a compiled function is held batch on `"data"` and heads on `"model"`, and a
    plain array is replicated. `mesh=None` returns `tree` unchanged.
    """
    if mesh is None:
        return tree
    placements = shardings(tree, mesh, rules)
    return jax.tree.map(
        lambda x, s: x if s is None else jax.lax.with_sharding_constraint(x, s),
        tree,
        placements,
        is_leaf=lambda x: x is None,
    )


# -- logical axes to partition specs -------------------------------------------------------


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))


def _map_arrays(tree, fn):
    """`fn(x, axes, counts, where)` on every array; `axes` is None outside decoders/caches."""

    def visit(path, node):
        if isinstance(node, RotaryDecoder):
            return _map_decoder(node, fn, jax.tree_util.keystr(path))
        if isinstance(node, KVCache):
            return _map_cache(node, fn, jax.tree_util.keystr(path))
        if _is_array(node):
            return fn(node, None, {}, jax.tree_util.keystr(path))
        return None

    is_node = lambda x: isinstance(x, (RotaryDecoder, KVCache))
    return jax.tree_util.tree_map_with_path(visit, tree, is_leaf=is_node)


def _map_decoder(model: RotaryDecoder, fn, prefix: str):
    counts = axis_counts(model.config)

    def visit(path, x):
        if not _is_array(x):
            return None
        where = prefix + jax.tree_util.keystr(path)
        unstacked = len(path) > 1 and isinstance(path[1], jax.tree_util.SequenceKey)
        if unstacked:  # `blocks[i]....` of an unstacked model: the row without `blocks`
            path = path[:1] + path[2:]
        name = ".".join(str(getattr(entry, "name", entry)) for entry in path)
        if name not in BY_PATH:
            adapted = any(name.startswith(row + ".") for row in BY_PATH)
            raise TypeError(
                f"eqrope.shard has no logical axes for {where}: an adapter's array "
                "(eqrope.lora); place an adapted model with eqrope.adapter_shardings."
                if adapted
                else f"eqrope.shard has no logical axes for {where}; add a row for "
                f"{name!r} to eqrope.weights._table.WEIGHTS."
            )
        axes = BY_PATH[name].axes
        return fn(x, axes[1:] if unstacked else axes, counts, where)

    return jax.tree_util.tree_map_with_path(visit, model)


def _map_cache(cache: KVCache, fn, prefix: str):
    def visit(path, x):
        if not _is_array(x):
            return None
        where = prefix + jax.tree_util.keystr(path)
        per_block = isinstance(path[-1], jax.tree_util.SequenceKey)  # one block's buffer
        name = getattr(path[-2] if per_block else path[-1], "name", None)
        if name not in _CACHE_AXES:
            raise TypeError(
                f"eqrope.shard has no logical axes for {where}; add its field name to "
                "eqrope.sharding._rules._CACHE_AXES."
            )
        axes = _CACHE_AXES[name][1:] if per_block else _CACHE_AXES[name]
        axes = (("batch",) if np.ndim(x) == len(axes) + 1 else ()) + axes
        counts = dict(zip(axes, np.shape(x)))
        return fn(x, axes, counts, where)

    return jax.tree_util.tree_map_with_path(visit, cache)


def _spec(x, axes, counts, where: str, mesh: Mesh | AbstractMesh, rules: ShardingRules) -> PartitionSpec:
    """The partition spec of `x`, whose dimensions have logical `axes`."""
    if axes is None or np.ndim(x) != len(axes):
        # Outside the decoder's own arrays (counters, or an optimiser's factored
        # moments whose shape is not the parameter's): replicated.
        return PartitionSpec()
    entries = []
    for dim, parts in enumerate(axes):
        parts = parts if isinstance(parts, tuple) else (parts,)
        targets = {rules.axis(p) for p in parts if p is not None}
        target = targets.pop() if len(targets) == 1 else None
        if target is None:
            entries.append(None)
            continue
        size = mesh_size(mesh, target)
        for part in dict.fromkeys(parts):
            if counts[part] % size != 0:
                raise ValueError(
                    f"Cannot shard {where}: its {part!r} dimension ({counts[part]}) does not "
                    f"split evenly over mesh axis {target!r} ({size} devices). Use a mesh whose "
                    f"{target!r} size divides {counts[part]}, or ShardingRules({part}=None) "
                    "to replicate it."
                )
        if np.shape(x)[dim] % size != 0:
            # Only an optimiser moment shaped unlike its parameter gets here.
            return PartitionSpec()
        entries.append(target)
    used = [a for e in entries for a in axis_names(e)]
    repeated = sorted({a for a in used if used.count(a) > 1})
    if repeated:
        raise ValueError(
            f"Cannot shard {where}: the rules put two of its dimensions {tuple(axes)} on mesh "
            f"axis {repeated[0]!r}; map one of them to another mesh axis or to None."
        )
    return PartitionSpec(*entries)


def _check_mesh(mesh, rules: ShardingRules) -> None:
    check_mesh(mesh, {logical: rules.axis(logical) for logical in _RULE_AXES})
