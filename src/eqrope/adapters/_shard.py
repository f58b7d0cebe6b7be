"""Placing an adapted model on a device mesh: the adapters follow their base weight's rules.

The base arrays take [`eqrope.shardings`][]' placement. An adapter on a weight whose
dimensions have logical axes `(d_in, d_out)` has `A` on `(d_in, None)` and `B` on
`(None, part)`, `part` being its own fused part's axis (`heads` for q, `kv_heads` for k
and v, `d_ff` for gate and up), so each device holds the rows of `A` and the columns of
`B` that meet its shard of the weight, and the rank is replicated.
"""

import equinox as eqx
import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from ..model._decoder import RotaryDecoder
from ..sharding._rules import ShardingRules, _spec, shardings
from ..weights._table import BY_PATH, axis_counts
from ._weight import LoraWeight, is_lora, lora_weights


def adapter_shardings(tree, mesh: Mesh | AbstractMesh, rules: ShardingRules | None = None):
    """The `NamedSharding` of every array of `tree`, which may hold adapted models
    ([`eqrope.lora`][], also stacked or selected adapters) and their optimizer states
    ([`eqrope.init_adapter_optimizer`][]: their moments have the adapters' structure).

    Everything but the adapters is placed as [`eqrope.shardings`][] places it; each
    adapter's `A` follows its weight's input axis and `B` its part's output axis (the
    rank, stacked adapters' axis and per-row ids replicated). Place with
    `jax.tree.map(jax.device_put, tree, adapter_shardings(tree, mesh))`, or pass the
    result to `jax.jit` as `in_shardings`/`out_shardings`; the adapter train step keeps
    the placement it is given.
    """
    rules = ShardingRules() if rules is None else rules
    is_node = lambda x: isinstance(x, RotaryDecoder)  # noqa: E731

    def visit(node):
        if is_node(node) and lora_weights(node):
            return _decoder(node, mesh, rules)
        return shardings(node, mesh, rules)

    return jax.tree.map(visit, tree, is_leaf=is_node)


def _decoder(model: RotaryDecoder, mesh, rules: ShardingRules):
    stacked = model.layout == "stacked"
    counts = axis_counts(model.config)
    replicated = NamedSharding(mesh, PartitionSpec())

    def stand_in(w: LoraWeight):
        """The base weight, or its shape where an optimizer state has `None` there."""
        if w.weight is not None:
            return w.weight
        p = next(p for p in w.parts if p is not None)
        lead = p.a.shape[: 1 if stacked else 0]
        return jax.ShapeDtypeStruct((*lead, p.a.shape[-2], sum(w.widths)), p.a.dtype)

    plain = jax.tree.map(lambda x: stand_in(x) if is_lora(x) else x, model, is_leaf=is_lora)
    placed = shardings(plain, mesh, rules)

    def place(w, weight_sharding):
        if not is_lora(w):
            return weight_sharding
        row = BY_PATH[w.path]
        axes = row.axes if stacked else row.block_axes
        lead, d_in, d_out = axes[:-2], axes[-2], axes[-1]
        outs = d_out if isinstance(d_out, tuple) else (d_out,)
        parts = []
        for p, out in zip(w.parts, outs):
            if p is None:
                parts.append(None)
                continue
            extra = (None,) * (p.a.ndim - len(axes))  # the `adapters` axis, after `blocks`
            where = f"the adapter on {w.path} ({out})"
            spec = lambda x, ax: None if x is None else NamedSharding(mesh, _spec(x, ax, counts, where, mesh, rules))  # noqa: E731
            a = spec(p.a, (*lead, *extra, d_in, None))
            b = spec(p.b, (*lead, *extra, None, out))
            parts.append(eqx.tree_at(lambda q: (q.a, q.b), p, (a, b), is_leaf=lambda x: x is None))
        out = eqx.tree_at(lambda x: x.parts, w, tuple(parts), is_leaf=lambda x: x is None)
        return eqx.tree_at(
            lambda x: (x.weight, x.rows, x.key),
            out,
            (
                None if w.weight is None else weight_sharding,
                None if w.rows is None else replicated,
                None if w.key is None else replicated,
            ),
            is_leaf=lambda x: x is None,
        )

    return jax.tree.map(place, model, placed, is_leaf=is_lora)
