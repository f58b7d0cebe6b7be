"""Stop sequences: their padded table, and matching them at the end of a row's text.

The table is `(n_stop, stop_len)`: each sequence right-aligned, padded on the left with
`ANY` (matches every token), and spare rows of `NONE`, which no token equals. Both sizes
are at least `MIN_SHAPE` and powers of two, so that any list of up to four sequences of
up to four tokens runs one compiled program, and larger lists one program per size
bucket; the ids are traced values. No stop list is a bucket of its own, `(0, stop_len)`:
its program holds no matching at all (a call that then passes a stop compiles once
more). A text ends with a stop sequence when its last `stop_len` tokens (with `BEFORE`
for positions before the text) match a row of the table.
"""

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int


ANY = -2
BEFORE = -1
NONE = -1
MIN_SHAPE = (4, 4)


def _bucket(n: int) -> int:
    return 1 << (n - 1).bit_length()


def stop_table(stop: Sequence[Sequence[int]] | None) -> np.ndarray:
    """The padded `(n_stop, stop_len)` int32 table of checked token-id sequences; no
    rows without any."""
    stop = list(stop or ())
    if not stop:
        return np.full((0, MIN_SHAPE[1]), NONE, np.int32)
    rows = max(_bucket(len(stop)), MIN_SHAPE[0])
    width = max(_bucket(max(map(len, stop), default=1)), MIN_SHAPE[1])
    table = np.full((rows, width), ANY, np.int32)
    table[len(stop) :] = NONE  # spare rows: never match
    for i, sequence in enumerate(stop):
        table[i, width - len(sequence) :] = sequence
    return table


def holds_stops(table) -> bool:
    """Whether a table (or a table per row) has any row: a static fact (its shape); the
    table of no stop list has none, and its program matches nothing."""
    return np.shape(table)[-2] > 0


def ends_with_stop(
    tokens: Int[Array, " max_len"], pos: Int[Array, ""], table: Int[Array, "n_stop stop_len"]
) -> Bool[Array, ""]:
    """Whether `tokens[: pos + 1]` ends with a stop sequence of `table`."""
    width = table.shape[1]
    index = pos - (width - 1) + jnp.arange(width, dtype=pos.dtype)
    window = jnp.where(index >= 0, tokens[jnp.clip(index, 0, tokens.shape[0] - 1)], BEFORE)
    return jnp.any(jnp.all((table == window[None, :]) | (table == ANY), axis=-1))


def host_ends_with_stop(text: Sequence[int], table: np.ndarray) -> bool:
    """`ends_with_stop` for a Python list: the uncached reference path's check."""
    for row in np.asarray(table).tolist():
        sequence = [t for t in row if t != ANY]
        if sequence != [NONE] and len(text) >= len(sequence) and list(text[-len(sequence) :]) == sequence:
            return True
    return False
