"""Rolling windows: a row longer than one pass is cut into windows of `window + 1` tokens
whose ends advance by `stride` (each token scored once), and pieces run in plain passes,
each row of a pass with its own adapter where they are chosen per row.
"""

import dataclasses
from collections.abc import Callable, Sequence

import equinox as eqx
import jax
import numpy as np

from ..adapters._weight import is_lora, lora_weights
from ._buckets import bucket, round_up
from ._plain import plain_pass


@dataclasses.dataclass(frozen=True)
class Piece:
    """What one row of a plain pass reads and scores: the row's tokens `start .. last - 1`
    are read, and positions `first .. last` (inclusive) are scored, each from the
    logits of the position before it."""

    row: int
    start: int
    first: int
    last: int


def rolling_windows(
    row: int, length: int, first: int, window: int, stride: int | None
) -> list[Piece]:
    """The pieces that score positions `first .. length - 1` of a row of `length` tokens.

    One piece when `length <= window + 1`. Otherwise (with `stride`) window `k` ends at
    position `e_k = min(length - 1, window + k * stride)`, reads the `window` tokens
    before it and scores positions `e_{k-1} + 1 .. e_k` (from `first` on); this is
    `lm_eval.utils.get_rolling_token_windows` with `context_len = window - stride + 1`,
    passed through `make_disjoint_window`.
    """
    last = length - 1
    if last <= window:
        return [Piece(row, 0, first, last)]
    pieces, done, k = [], first - 1, 0
    while done < last:
        end = min(last, window + k * stride)
        if end > done:
            pieces.append(Piece(row, max(0, end - window), done + 1, end))
            done = end
        k += 1
    return pieces


def run_pieces(
    model,
    ids: np.ndarray | Sequence[np.ndarray],
    pieces: Sequence[Piece],
    *,
    rows: int,
    window: int,
    multiple: int = 1,
    mesh=None,
    rules=None,
    on_pass: Callable[[int], object] | None = None,
):
    """Run `pieces` of the rows of `ids` (a 2-D array, or a list of 1-D rows) in plain
    passes of `rows` rows (the last padded), the longest first; yield `(piece, logprobs,
    greedy)` for each, over its scored positions only. `on_pass(n)` is called after each
    pass with the number of pieces it held."""
    order = sorted(range(len(pieces)), key=lambda i: pieces[i].start - pieces[i].last)
    rows = round_up(rows, multiple)
    for begin in range(0, len(order), rows):
        chunk = [pieces[i] for i in order[begin : begin + rows]]
        width = bucket(max(p.last - p.start for p in chunk), window)
        inputs = np.zeros((rows, width), np.int32)
        targets = np.zeros((rows, width), np.int32)
        lo = np.zeros((rows,), np.int32)
        hi = np.zeros((rows,), np.int32)
        for j, p in enumerate(chunk):
            n = p.last - p.start
            inputs[j, :n] = ids[p.row][p.start : p.last]
            targets[j, :n] = ids[p.row][p.start + 1 : p.last + 1]
            lo[j], hi[j] = p.first - p.start - 1, n
        # Row j of the pass reads a piece of row `chunk[j].row` (the pads, of row 0).
        owners = [p.row for p in chunk] + [0] * (rows - len(chunk))
        adapted = adapters_of_rows(model, np.asarray(owners, np.int32))
        logprobs, greedy = plain_pass(adapted, inputs, targets, lo, hi, mesh=mesh, rules=rules)
        for j, p in enumerate(chunk):
            yield p, logprobs[j, lo[j] : hi[j]], greedy[j, lo[j] : hi[j]]
        if on_pass is not None:
            on_pass(len(chunk))


def adapted_rows(model) -> int | None:
    """The rows of the batch `model`'s adapters are chosen for
    ([`eqrope.select_adapters`][]), or `None` where they are not chosen per row."""
    return next((w.rows.shape[-1] for w in lora_weights(model) if w.rows is not None), None)


def adapters_of_rows(model, owners: np.ndarray):
    """`model` for a pass whose row `j` is (a piece of) row `owners[j]` of the batch: where
    its adapters are chosen per row, row `j` gets the adapter of row `owners[j]`, so that
    reordering, padding or splitting the rows into passes keeps each row with its adapter.
    Any other model is returned as it is. The assignment is an array: a new one compiles
    nothing."""
    if adapted_rows(model) is None:
        return model

    def reassign(w):
        if not is_lora(w) or w.rows is None:
            return w
        return eqx.tree_at(lambda x: x.rows, w, w.rows[..., owners])  # stacked: (blocks, rows)

    return jax.tree.map(reassign, model, is_leaf=is_lora)
