"""A constraint on the text, as a deterministic automaton over token ids (host arrays).

This file holds only the exchange format between the two halves of structured output:
`eqrope.structured` compiles a regex, a choice list or a JSON schema against a tokenizer
into an `Automaton`; the generate loop (`_constraint.py`) carries each row's state in its
compiled program and masks the logits with that state's allowed tokens.
"""

from typing import NamedTuple

import numpy as np


class Automaton(NamedTuple):
    """A deterministic automaton over the token ids `0 .. vocab - 1`, in a compact layout
    (NumPy arrays, on the host).

    States are numbered `0 .. S - 1`; the start state is 0. End-of-sequence ids are not
    part of the table: a row may end (with any of its EOS ids) exactly in an `accepting`
    state.

    - `allowed`: `uint32 (S, ceil(vocab / 32))`: bit `t % 32` of word `t // 32` of row `s`
      is set when token `t` may follow in state `s`.
    - `default_next`: `int32 (S,)`: the next state after an allowed token of state `s`
      that has no exception (the most common next state of `s`).
    - `exc_start`: `int32 (S + 1,)`: the exceptions of state `s` are entries
      `exc_start[s] .. exc_start[s + 1] - 1` of the next two arrays.
    - `exc_token`: `int32 (E,)`: the exceptions' tokens, sorted within each state.
    - `exc_next`: `int32 (E,)`: the exceptions' next states.
    - `accepting`: `bool (S,)`: where the text may end.
    - `vocab`: the number of token ids the table covers.
    """

    allowed: np.ndarray
    default_next: np.ndarray
    exc_start: np.ndarray
    exc_token: np.ndarray
    exc_next: np.ndarray
    accepting: np.ndarray
    vocab: int
