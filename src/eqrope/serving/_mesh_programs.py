"""The engine's programs on a mesh: each data shard runs the one-device program on its part.

`mesh_programs` compiles `_programs.py`'s four programs for a mesh (the layout is
`_mesh_layout.py`'s). Prefill, decode and the page copy are `jax.shard_map`s over the
data axis only: inside, a shard sees its own rows, its slots' text and its block of the
pool, exactly the arrays of a one-device engine of `slots / D` slots and `pages / D`
pages, and the `model` axis stays automatic, so XLA splits the heads, the feed-forward
width and the vocabulary of the weights (and the pool's key/value heads) and inserts the
collectives, as it does for `eqrope.generate(..., mesh=)`. The start of one slot is a
plain compiled program over the whole text (a row of one shard changes). Every program
returns the pool and the text with the placements they came in with, so a call never
meets a new input sharding and never compiles after `Engine.warmup`.

One rule keeps the devices in step: a collective over the model axis must be reached by
every device of the program (XLA's CPU collectives wait for all of them), so no loop or
branch that holds one may follow one shard's data. The decode loop's condition and the
cache bounds are taken over all shards (`data_axis` in `_programs.py`), and the logits
are gathered whole before the sampler, whose `lax.cond`s follow each shard's settings.
(Found the hard way: without either, a (2,4) mesh waits forever.)
"""

import functools
from typing import NamedTuple

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ..sharding import ShardingRules, shard
from ..sharding._mesh import axis_names, mesh_size
from ._programs import Programs, copy_pages, decode_chunk, prefill_pieces, start_slot


class Placed(NamedTuple):
    """The model's weights, the pool and the text placed on a mesh, and its programs."""

    model: object
    pool: object
    text: object
    programs: Programs


def place_on_mesh(model, pool, text, mesh: Mesh, rules: ShardingRules | None) -> Placed:
    """Place the unstacked `model` by `rules`, the pool's pages on the data axis and its
    key/value heads as the rules place them, and the text's slots on the data axis.

    Raises `ValueError` naming the fix when the key/value heads do not split over their
    mesh axis.
    """
    rules = ShardingRules() if rules is None else rules
    data, heads = rules.batch, rules.kv_heads
    kv_heads = pool.keys[0].shape[0]
    if kv_heads % mesh_size(mesh, heads):
        raise ValueError(
            f"the pool's {kv_heads} key/value heads do not split over mesh axis {heads!r} "
            f"({mesh_size(mesh, heads)} devices); use a mesh whose {heads!r} size divides "
            f"{kv_heads}, or pass rules=eqrope.ShardingRules(kv_heads=None) to replicate them."
        )
    pool_at, text_at = NamedSharding(mesh, P(heads, data)), NamedSharding(mesh, P(data))
    model = shard(model, mesh, rules)
    pool, text = jax.device_put(pool, pool_at), jax.device_put(text, text_at)
    return Placed(model, pool, text, mesh_programs(mesh, data, pool_at, text_at))


def mesh_programs(mesh: Mesh, data, pool_at: NamedSharding, text_at: NamedSharding) -> Programs:
    """The engine's programs, each data shard running the one-device program on its part."""
    rows, whole, blocks = P(data), P(), P(None, data)  # the pool's page axis is its second
    replicated = NamedSharding(mesh, P())
    pin = jax.lax.with_sharding_constraint

    def per_shard(body, in_specs, out_specs):
        return jax.shard_map(
            body, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
            axis_names=frozenset(axis_names(data)), check_vma=False,
        )  # fmt: skip

    @functools.partial(jax.jit, static_argnames=("structure", "chunk"), donate_argnames=("pool",))
    def prefill(arrays, pool, tables, ids, starts, last, live, *, structure, chunk):
        body = functools.partial(prefill_pieces, structure=structure, chunk=chunk, data_axis=data)
        specs = (whole, blocks, rows, rows, rows, rows, rows)
        pool, logits = per_shard(body, specs, (blocks, rows))(arrays, pool, tables, ids, starts, last, live)
        # One replicated array per row, as `start` takes them.
        return pin(pool, pool_at), tuple(pin(logits, replicated))

    @functools.partial(jax.jit, static_argnames=("structure", "chunk"), donate_argnames=("pool", "text"))
    def decode(arrays, pool, text, slots, live, tables, sampling, keys, max_new, steps, exit_after, check_finite, *,
               structure, chunk):  # fmt: skip
        body = functools.partial(decode_chunk, structure=structure, chunk=chunk, data_axis=data)
        specs = (whole, blocks, rows, rows, rows, rows, rows, rows, rows, whole, whole, whole)
        pool, text, view = per_shard(body, specs, (blocks, rows, rows))(
            arrays, pool, text, slots, live, tables, sampling, keys, max_new, steps, exit_after, check_finite
        )
        # Over several processes, process 0 reads every row (`_processes.py`).
        return pin(pool, pool_at), pin(text, text_at), view if jax.process_count() == 1 else pin(view, replicated)

    @functools.partial(jax.jit, donate_argnames=("pool",))
    def copy(pool, sources, targets):
        return pin(per_shard(copy_pages, (blocks, rows, rows), blocks)(pool, sources, targets), pool_at)

    start = jax.jit(start_slot, donate_argnames=("text",), out_shardings=(text_at, replicated))
    return Programs(prefill, start, decode, copy)
