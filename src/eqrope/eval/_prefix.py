"""A shared prefix: each group's prefix is prefilled once into a cache, and every row of the
group (a continuation) runs against that cache, as the choices of a question need.
"""

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .._log import compiling
from ..generation._arrays import rebuild, split_model
from ..sharding._rules import constrain, shard_batch
from ._buckets import MIN_CONTINUATION_BUCKET, bucket, round_up
from ._plain import token_scores


@dataclasses.dataclass(frozen=True)
class Continuation:
    """A row after a shared prefix: its tokens, and the first of them to score."""

    ids: np.ndarray
    first: int = 0


@dataclasses.dataclass(frozen=True)
class Group:
    """Rows that share a prefix (at least one token)."""

    prefix: np.ndarray
    rows: Sequence[Continuation]


def run_groups(
    model,
    groups: Sequence[Group],
    *,
    rows: int,
    multiple: int = 1,
    mesh=None,
    rules=None,
    on_pass: Callable[[int], object] | None = None,
):
    """Score every row of `groups` against its group's prefix, in passes of about `rows`
    rows; yield `((group, row), logprobs, greedy)` for each row, over its tokens (0 and
    `False` before its `first`).

    The prefix's last token is read with the rows: the prefix pass writes the cache of the
    others only, and needs no logits (XLA drops its head). A pass holds `g` groups of `n`
    rows each, `n` the power of two that holds the pass's largest group and `g = rows //
    n` (at least 1); a group of more than `rows` rows is split. The caller orders the
    groups (longest prefix first keeps the buckets tight); `on_pass(n)` is called after
    each pass with the number of real rows it held.
    """
    parts = []  # (group index, first row index, rows)
    for g, group in enumerate(groups):
        for begin in range(0, len(group.rows), rows):
            parts.append((g, begin, group.rows[begin : begin + rows]))
    begin = 0
    while begin < len(parts):
        width = 1 << (len(parts[begin][2]) - 1).bit_length()
        count = 1
        while begin + count < len(parts):
            wider = max(width, 1 << (len(parts[begin + count][2]) - 1).bit_length())
            if (count + 1) * wider > rows:
                break
            width, count = wider, count + 1
        n_groups = round_up(max(1, rows // width), multiple)
        chunk = parts[begin : begin + count]
        begin += count
        yield from _group_pass(model, groups, chunk, n_groups, width, mesh, rules)
        if on_pass is not None:
            on_pass(sum(len(part[2]) for part in chunk))


def _group_pass(model, groups, chunk, n_groups: int, width: int, mesh, rules):
    max_len = model.max_len
    longest_prefix = max(len(groups[g].prefix) - 1 for g, _, _ in chunk)
    p = bucket(longest_prefix, max_len) if longest_prefix else 0
    c = bucket(
        max(len(r.ids) for _, _, part in chunk for r in part), max_len, MIN_CONTINUATION_BUCKET
    )
    # Room for the prefix and the rows, at most max_len: the prefix's write (rows
    # `0 .. p - 1`) fits, as `p <= max_len`, and the rows' writes fit as placed below.
    cache_len = min(p + c, max_len)
    prefix = np.zeros((n_groups, p), np.int32)
    starts = np.zeros((n_groups,), np.int32)
    inputs = np.zeros((n_groups, width, c), np.int32)
    targets = np.zeros((n_groups, width, c), np.int32)
    lo = np.zeros((n_groups, width), np.int32)
    hi = np.zeros((n_groups, width), np.int32)
    shifts = np.zeros((n_groups,), np.int32)
    for j, (g, _, part) in enumerate(chunk):
        context = groups[g].prefix
        prefix[j, : len(context) - 1] = context[:-1]
        # The rows' pass writes cache rows `start .. start + c - 1`, which must lie inside
        # the cache: `jax.lax.dynamic_update_slice` would move a write past the end back
        # over the prefix's last rows (an unstacked model's pass then reads them). Where
        # `len(context) - 1 + c` passes the cache, the pass starts `shift` tokens earlier,
        # on the prefix's own last tokens: it rewrites their cache rows with the same keys
        # and values, and their scores are dropped. It fits, since every row of a group
        # fits the model (`len(context) + n <= max_len + 1`, checked by the callers).
        shifts[j] = max(0, len(context) - 1 + c - cache_len)
        starts[j] = len(context) - 1 - shifts[j]
        lead = context[len(context) - 1 - shifts[j] :]  # the shifted tokens, then the last
        for k, row in enumerate(part):
            n = len(row.ids) + shifts[j]
            if n > c:  # the callers refuse such rows first
                raise ValueError(
                    f"a prefix of {len(context)} tokens and a row of {len(row.ids)} hold more "
                    f"than max_len + 1 = {max_len + 1} tokens; shorten the prefix or the row."
                )
            inputs[j, k, : len(lead)] = lead
            inputs[j, k, len(lead) : n] = row.ids[:-1]
            targets[j, k, : shifts[j]] = lead[1:]
            targets[j, k, shifts[j] : n] = row.ids
            lo[j, k], hi[j, k] = shifts[j] + row.first, n
    arrays = (prefix, starts, inputs, targets, lo, hi)
    if mesh is not None:
        arrays = shard_batch(arrays, mesh, rules)
    model_arrays, structure = split_model(model)
    out = _group_program(
        model_arrays, *arrays, cache_len=cache_len, structure=structure, mesh=mesh, rules=rules
    )
    logprobs, greedy = (np.asarray(x) for x in out)
    for j, (g, first_row, part) in enumerate(chunk):
        for k, row in enumerate(part):
            scored = slice(shifts[j], shifts[j] + len(row.ids))
            yield (g, first_row + k), logprobs[j, k, scored], greedy[j, k, scored]


@functools.partial(jax.jit, static_argnames=("cache_len", "structure", "mesh", "rules"))
def _group_program(
    arrays, prefix, starts, inputs, targets, lo, hi, *, cache_len, structure, mesh, rules
):
    """Prefill each group's prefix into a cache of `cache_len` rows, then run each of its
    rows against it.

    `prefix (groups, p)`: every token of the prefix but its last; `starts (groups,)`: the
    position of each group's rows pass (the cache rows it sees), at most the prefix's
    length less one, and `starts + c <= cache_len`. `inputs (groups, n, c)`: the tokens the pass
    reads from `starts` on (the prefix's last tokens from `starts`, then the row's tokens
    but its last); `targets`: each input's next token.
    """
    groups, n, c = inputs.shape
    compiling(
        "eval",
        "score",
        f"{groups} groups x {n} rows x {c} tokens after a prefix of {prefix.shape[1]}",
        "rows, prefix or length bucket",
    )
    model = rebuild(arrays, structure)

    def prefill(ids):
        cache = model.init_cache(max_len=cache_len)
        if prefix.shape[1] == 0:
            return cache
        return model.prefill(ids, cache, 0, check=False)[1]

    caches = constrain(jax.vmap(prefill)(prefix), mesh, rules)
    # Unbatched bounds, so that the cache's chunk skips stay skips under vmap.
    bound, low = jnp.max(starts), jnp.min(starts)

    def row(cache, start, ids):
        return model.prefill(ids, cache, start, check=False, kv_bound=bound, kv_low=low)[0]

    logits = jax.vmap(jax.vmap(row, in_axes=(None, None, 0)))(caches, starts, inputs)
    return constrain(token_scores(logits, targets, lo, hi), mesh, rules)
