"""The engine's device side: four compiled programs over the pool and the slots' text.

- `prefill_program`: pieces of up to `rows` prompts, `size` tokens each, written to the
  pool; the head's logits only at each prompt's last position (where a piece holds it).
- `start_program`: a prompt's last logits into a slot: the slot's text row, its first
  token (sampled with its own settings and key, as `generate` samples it), its history.
- `decode_program`: a `while_loop` of up to `steps` decode steps over a few slots (a
  bucket of the slot count), each slot with its own settings, key and page table. It
  stops early once `exit_after` slots have finished (a waiting request can take one).
- `copy_program`: pages copied within the pool (a sample's own partial prompt page).

Every setting is a traced array, so a new mix of requests compiles nothing; the shapes
are the slot count, the pool, the cache length, the capacities of the id lists and of
the stop-string tables, the prefill piece sizes and the decode buckets, all fixed when
the engine is built.

Each program is a plain function (`prefill_pieces`, `start_slot`, `decode_chunk`,
`copy_pages`) compiled here for one device and by `_mesh_programs.py` for a mesh, where
each data shard runs it on its own slots and pages.
"""

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from .._log import compiling
from ..generation._arrays import rebuild
from ..generation._processors import History, prompt_history
from ..generation._constraint import FREE
from ..generation._sampling import Sampling
from ..generation._state import TextState, check_logits, commit, start_text
from ._constraints import SlotConstraints, choose_slots
from ._paged_cache import PagedCache, page_rows


def _log(program: str, shapes: str) -> None:
    compiling("serving", program, shapes, "engine shape")


def prefill_pieces(
    arrays,
    pool: PagedCache,
    tables: Int[Array, "rows max_pages"],
    ids: Int[Array, "rows size"],
    starts: Int[Array, " rows"],
    last: Int[Array, " rows"],
    live: Bool[Array, " rows"],
    *,
    structure,
    chunk: int,
    data_axis=None,
) -> tuple[PagedCache, Float[Array, "rows vocab"]]:
    """Run piece `ids[r]` of prompt `r` at positions `starts[r] ..` against its pages
    `tables[r]`, and write its keys and values there (rows that are not `live`, and
    pieces of the null table, write to the null page). **Returns:** `(pool, logits)`,
    the float32 logits at position `starts[r] + last[r]` of each row.

    Inside a `shard_map` over `data_axis`, every shard reads the cache's chunks up to the
    furthest start of any shard's rows, so that every device runs the same loops (a
    collective over the model axis in a loop needs every device there); the chunks past
    a row's own start are masked, and change nothing."""
    _log("engine prefill", f"{ids.shape[0]} prompts x {ids.shape[1]} tokens")
    model = rebuild(arrays, structure)
    size, page_size = ids.shape[1], pool.page_size

    bounds = {}
    if data_axis is not None:
        bounds = dict(kv_bound=_across(jnp.max(starts), data_axis, jax.lax.pmax),
                      kv_low=_across(jnp.min(starts), data_axis, jax.lax.pmin))  # fmt: skip

    def one(piece, start, at, table):
        positions = start + jnp.arange(size, dtype=jnp.int32)
        view = pool.view(table, chunk)
        logits, keys, values = model.forward(piece, positions, view, logits_at=at[None], **bounds)
        return logits[0].astype(jnp.float32), keys, values

    logits, keys, values = jax.vmap(one)(ids, starts, last, tables)
    positions = starts[:, None] + jnp.arange(size, dtype=jnp.int32)
    pages, offsets = page_rows(tables, positions, live[:, None], page_size)
    pool = pool.write(_rows_last(keys), _rows_last(values), pages.reshape(-1), offsets.reshape(-1))
    return pool, logits


@functools.partial(jax.jit, static_argnames=("structure", "chunk"), donate_argnames=("pool",))
def prefill_program(arrays, pool: PagedCache, tables, ids, starts, last, live, *, structure, chunk: int):
    """`prefill_pieces` with the logits as one array per row: the host hands each to
    `start_program` without slicing (a slice of a device array is a program of its own)."""
    pool, logits = prefill_pieces(arrays, pool, tables, ids, starts, last, live, structure=structure, chunk=chunk)
    return pool, tuple(logits)


def _rows_last(new: Float[Array, "rows blocks kv_heads size head_dim"]) -> Float[Array, "blocks kv_heads n head_dim"]:
    """Every row's new keys (or values) as one run of rows per block, row-major."""
    rows, blocks, kv_heads, size, head_dim = new.shape
    return jnp.transpose(new, (1, 2, 0, 3, 4)).reshape(blocks, kv_heads, rows * size, head_dim)


def start_slot(
    text: TextState,
    slot: Int[Array, ""],
    logits: Float[Array, " vocab"],
    prompt: Int[Array, " max_len"],
    length: Int[Array, ""],
    sampling: Sampling,
    key,
    max_new: Int[Array, ""],
    check_finite: Bool[Array, ""],
    constraint: SlotConstraints | None = None,
    state: Int[Array, ""] | None = None,
):
    """Slot `slot` takes the prompt `prompt[:length]` and its first token, drawn from the
    prompt's last `logits` with the slot's settings (fields with a leading axis of one),
    masked by its automaton (from `state`) with a `constraint` (`_constraints.py`).

    **Returns:** `(text, first)`, and the slots' automaton states after them with a
    `constraint`: `first` is the token, its log-probability, and whether the sample is
    done and whether its logits were non-finite, for the host."""
    _log("engine start", f"a slot of {prompt.shape[0]} positions")
    lengths = length[None]
    history = jax.vmap(functools.partial(prompt_history, vocab=logits.shape[-1]))(prompt[None], lengths)
    row = start_text(prompt[None], lengths, history, max_new[None])
    logits = logits[None]
    row, active = _checked(check_finite, row, logits, ~row.done)
    table, states = (None, None) if constraint is None else (constraint.table, state[None])
    row, active, (token, logprob, own), states = choose_slots(table, states, logits, row, active, key[None], sampling)
    row = commit(row, token, logprob, own, active, max_new[None], sampling, None)
    text = jax.tree.map(lambda all_rows, one: all_rows.at[slot].set(one[0]), text, row)
    first = (row.tokens[0, length], row.logprobs[0, length], row.done[0], row.nonfinite[0])
    if constraint is None:
        return text, first
    return text, first, constraint.states.at[slot].set(states[0])


start_program = jax.jit(start_slot, donate_argnames=("text",))


def decode_chunk(
    arrays,
    pool: PagedCache,
    text: TextState,
    rows: Int[Array, " bucket"],
    live: Bool[Array, " bucket"],
    tables: Int[Array, "bucket max_pages"],
    sampling: Sampling,
    keys,
    max_new: Int[Array, " bucket"],
    steps: Int[Array, ""],
    exit_after: Int[Array, ""],
    check_finite: Bool[Array, ""],
    constraint: SlotConstraints | None = None,
    *,
    structure,
    chunk: int,
    data_axis=None,
):
    """Up to `steps` decode steps of slots `rows` (those not `live` are padding and do
    nothing). Each step feeds each running slot's last token at its position, writes its
    key and value to its page, and commits the next token (masked by the slot's automaton
    with a `constraint`: `_constraints.py`). The loop ends early when `exit_after` slots
    have finished in it. Inside a `shard_map` over `data_axis`, the loop's condition and
    its cache bounds count every shard's rows: every device runs the same steps and the
    same chunks of the cache.

    **Returns:** `(pool, text, view)`, and the slots' automaton states with a
    `constraint`: `view` holds the `rows`' `tokens`, `logprobs`, `pos`, `done` and
    `nonfinite`, for the host.
    """
    _log("engine decode", f"{rows.shape[0]} slots, {text.tokens.shape[1]} positions")
    model = rebuild(arrays, structure)
    page_size, max_len = pool.page_size, text.tokens.shape[1]
    sub = jax.tree.map(lambda x: x[rows], text)
    sub = dataclasses.replace(sub, done=sub.done | ~live)
    index = jnp.arange(rows.shape[0])
    table = None if constraint is None else constraint.table
    # Padding rows are FREE: a slot's last state, left by an ended request, costs nothing.
    automata = None if constraint is None else jnp.where(live, constraint.states[rows], FREE)

    def step(carry):
        i, sub, automata, pool, finished = carry
        active = ~sub.done
        feed = jnp.maximum(sub.pos - 1, 0)
        token = sub.tokens[index, feed]
        # Unbatched bounds, so that every slot skips the chunks past the furthest one.
        bound = _across(jnp.max(jnp.where(active, feed, 0)), data_axis, jax.lax.pmax)
        low = _across(jnp.min(jnp.where(active, feed, max_len)), data_axis, jax.lax.pmin)

        def one(token, position, table):
            view = pool.view(table, chunk)
            logits, k, v = model.forward(token[None], position[None], view, kv_bound=bound, kv_low=low)
            return logits[0].astype(jnp.float32), k, v

        logits, k, v = jax.vmap(one)(token, feed, tables)
        if data_axis is not None:
            # Whole on every device of the model axis: the sampler's branches, taken on
            # each shard's own settings, then hold no collective that a device of another
            # shard would wait for.
            logits = jax.lax.with_sharding_constraint(logits, P())
        pages, offsets = page_rows(tables, feed, active, page_size)
        pool = pool.write(_rows_last(k), _rows_last(v), pages, offsets)
        sub, active = _checked(check_finite, sub, logits, active)
        done = sub.done
        sub, active, (token, logprob, own), automata = choose_slots(
            table, automata, logits, sub, active, keys, sampling
        )
        new = commit(sub, token, logprob, own, active, max_new, sampling, None)
        finished = finished + jnp.sum(new.done & ~done, dtype=jnp.int32)
        return i + 1, new, automata, pool, finished

    def going(carry):
        i, sub, _, _, finished = carry
        busy = _across(jnp.sum(~sub.done, dtype=jnp.int32), data_axis, jax.lax.psum)
        return (i < steps) & (busy > 0) & (_across(finished, data_axis, jax.lax.psum) < exit_after)

    zero = jnp.zeros((), jnp.int32)
    _, sub, automata, pool, _ = jax.lax.while_loop(going, step, (zero, sub, automata, pool, zero))
    text = jax.tree.map(lambda all_rows, some: all_rows.at[rows].set(some), text, sub)
    view = {name: getattr(sub, name) for name in ("tokens", "logprobs", "pos", "done", "nonfinite")}
    if constraint is None:
        return pool, text, view
    return pool, text, view, constraint.states.at[rows].set(automata)


decode_program = jax.jit(decode_chunk, static_argnames=("structure", "chunk"), donate_argnames=("pool", "text"))


def _across(x, data_axis, reduce):
    """`reduce` (`psum`, `pmax`, `pmin`) of `x` over the data shards, if any."""
    return x if data_axis is None else reduce(x, data_axis)


def _checked(check_finite, text: TextState, logits, active):
    """`check_logits` where `check_finite` (a traced setting), else `(text, active)`."""
    checked, still = check_logits(text, logits, active)
    pick = lambda a, b: jnp.where(check_finite, a, b)
    return jax.tree.map(pick, checked, text), pick(still, active)


def copy_pages(pool: PagedCache, sources: Int[Array, " n"], targets: Int[Array, " n"]) -> PagedCache:
    """Pages `targets` become copies of pages `sources`."""
    return pool.copy_pages(sources, targets)


copy_program = jax.jit(copy_pages, donate_argnames=("pool",))


class Programs(NamedTuple):
    """The four compiled programs a `Runner` calls: `prefill_program`, `start_program`,
    `decode_program` and `copy_program`, or their mesh forms (`_mesh_programs.py`)."""

    prefill: object
    start: object
    decode: object
    copy: object


ONE_DEVICE = Programs(prefill_program, start_program, decode_program, copy_program)


def empty_text(slots: int, max_len: int, vocab: int) -> TextState:
    """The text of `slots` empty slots, every one done (built on the host: no program)."""
    zeros = lambda shape, dtype: jnp.asarray(np.zeros(shape, dtype))
    return TextState(
        pos=zeros((slots,), np.int32),
        n_new=zeros((slots,), np.int32),
        done=jnp.asarray(np.ones((slots,), bool)),
        history=History(zeros((slots, vocab), bool), zeros((slots, vocab), np.int32)),
        tokens=zeros((slots, max_len), np.int32),
        logprobs=zeros((slots, max_len), np.float32),
        model_logprobs=zeros((slots, max_len), np.float32),
        nonfinite=zeros((slots,), bool),
    )
