"""The engine on a mesh: which data shard holds which slots and pages, and each call's rows.

[`eqrope.Engine`][] with `mesh=` splits its state over the `batch` rule's mesh axis (the
`data` axis of [`eqrope.make_mesh`][]) into `D` data shards, and its weights over the
`model` axis by the same [`eqrope.ShardingRules`][] as `eqrope.shard`:

- **Slots.** Shard `d` holds slots `d * S .. (d + 1) * S - 1` (`S = slots / D`): their
  rows of the slots' text (tokens, history, positions), and their settings and keys.
- **Pages.** The pool's page axis is split in `D` equal blocks of `P = pages / D` pages,
  and shard `d` owns block `d`: pages `d * P .. (d + 1) * P - 1`, page `d * P` its null
  page. The host keeps one `PagePool` per shard over those ids (prefix caching is per
  shard), so a page table only ever names pages of its own shard, and on the device each
  shard reads and writes only its own block: page id `p` is row `p % P` of the block.
- **Calls.** A prefill call or a decode chunk has the same number of rows on every
  shard: row `d * n + j` is row `j` of shard `d`'s `n`. Each shard runs the one-device
  program on its rows, its slots and its pages (`jax.shard_map` over the data axis, the
  model axis left to XLA: `_mesh_programs.py`), so nothing crosses the data axis and
  every sample's tokens are the one-device engine's.

The host stays one loop (`Engine.step`): the scheduler admits each request to the shard
with the most free slots that can hold its worst case, in the queue's order, and every
later page or slot of it comes from that shard. Without a mesh there is one shard, and
all of this is the one-device engine.
"""

from jax.sharding import AbstractMesh, Mesh

from ..sharding import ShardingRules
from ..sharding._mesh import axis_names, check_mesh, mesh_size


def data_shards(mesh: Mesh | AbstractMesh | None, rules: ShardingRules | None, slots: int) -> int:
    """How many data shards split the engine's slots and pages: 1 without a mesh.

    Raises `ValueError` for `rules` without a mesh, rules that put the batch on no mesh
    axis, or a slot count the data shards do not divide.
    """
    if mesh is None:
        if rules is not None:
            raise ValueError("rules say how to place the engine on a mesh; pass mesh= too.")
        return 1
    rules = ShardingRules() if rules is None else rules
    if not axis_names(rules.batch):
        raise ValueError(
            "the engine splits its slots over the mesh axis of ShardingRules.batch, but it is None; "
            "keep batch='data' and build the mesh with data=1 (eqrope.make_mesh(1, model)) to "
            "split only the weights."
        )
    check_mesh(mesh, {"batch": rules.batch})
    shards = mesh_size(mesh, rules.batch)
    if slots % shards:
        raise ValueError(
            f"slots={slots} must split evenly over the {shards} data shards of the mesh; build "
            f"the Engine with a multiple of {shards} slots."
        )
    return shards


def check_pages(pages: int, shards: int) -> int:
    """`pages` split in `shards` blocks of at least 2 (a null page and one to hand out).
    **Returns:** the pages of one block."""
    if pages % shards or pages // shards < 2:
        raise ValueError(
            f"pages={pages} must be a multiple of the {shards} data shards, at least 2 each "
            f"(each shard owns its block of the pool, its null page included); pass "
            f"pages={max(2, -(-pages // shards)) * shards}."
        )
    return pages // shards


def place_rows(groups: list[list], buckets: tuple[int, ...]) -> tuple[int, list[tuple[int, object]]]:
    """Lay out `groups[d]`, the items of shard `d`, as one call's rows.

    **Returns:** `(n, placed)`: `n` the smallest of `buckets` that holds every group (rows
    per shard), and `placed` the `(row, item)` pairs, item `j` of shard `d` at row
    `d * n + j`.
    """
    n = next(b for b in buckets if b >= max(map(len, groups)))
    return n, [(d * n + j, item) for d, group in enumerate(groups) for j, item in enumerate(group)]


def by_shard(items, shards: int, shard_of) -> list[list]:
    """`items` grouped by `shard_of(item)`, in order."""
    groups = [[] for _ in range(shards)]
    for item in items:
        groups[shard_of(item)].append(item)
    return groups


def decode_slots(slots: list, groups: list[list], n: int) -> list[int]:
    """The slot of each row of a decode chunk of `n` rows per shard: shard `d`'s running
    samples `groups[d]`, then its idle slots (no sample, or a finished one) as padding."""
    per_shard, rows = len(slots) // len(groups), []
    for d, group in enumerate(groups):
        own = range(d * per_shard, (d + 1) * per_shard)
        idle = [i for i in own if slots[i] is None or slots[i].finish_reason is not None]
        rows += [s.slot for s in group] + idle[: n - len(group)]
    return rows
