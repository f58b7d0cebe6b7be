"""An outlines-core `Index` exported as an `Automaton` (NumPy arrays, vectorised).

The index is of a regex followed by an END marker (`_compile.py`): a state accepts where
the END pseudo-token leads to a state where the index's regex matches. The index's state ids are sparse (regex_automata's); the
export numbers the states it keeps `0 .. S - 1`, the start state first. It drops the END
and EOS transitions (the traced side allows EOS exactly in `accepting` states) and every
state from which no accepting state can be reached (and the tokens that lead there), so
that every state of the table either accepts or has a token that leads on to an
accepting state.
"""

import numpy as np

from ..generation._automaton import Automaton


def _edges(transitions: dict[int, dict[int, int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`(state, token, next)` arrays of a `get_transitions()` dict (sparse state ids)."""
    counts = np.fromiter((len(row) for row in transitions.values()), np.int64, len(transitions))
    total = int(counts.sum())
    states = np.repeat(np.fromiter(transitions.keys(), np.int64, len(transitions)), counts)
    tokens = np.empty(total, np.int64)
    nexts = np.empty(total, np.int64)
    start = 0
    for row, n in zip(transitions.values(), counts.tolist()):
        tokens[start : start + n] = np.fromiter(row.keys(), np.int64, n)
        nexts[start : start + n] = np.fromiter(row.values(), np.int64, n)
        start += n
    return states, tokens, nexts


def _closure(seeds: np.ndarray, sources: np.ndarray, targets: np.ndarray, size: int) -> np.ndarray:
    """The states reachable from `seeds` along the edges `sources -> targets` (dense ids
    `0 .. size - 1`): a boolean mask."""
    order = np.argsort(sources, kind="stable")
    sources, targets = sources[order], targets[order]
    starts = np.searchsorted(sources, np.arange(size + 1))
    seen = np.zeros(size, bool)
    seen[seeds] = True
    frontier = np.flatnonzero(seen)
    while frontier.size:
        spans = [targets[starts[s] : starts[s + 1]] for s in frontier.tolist()]
        reached = np.unique(np.concatenate(spans)) if spans else np.empty(0, np.int64)
        frontier = reached[~seen[reached]]
        seen[frontier] = True
    return seen


def export(index, vocab: int, *, end_id: int, eos_id: int) -> tuple[Automaton, np.ndarray]:
    """Export an outlines-core `Index` over token ids `0 .. vocab - 1`.

    **Arguments:**

    - `index`: an `outlines_core.Index` of a regex followed by the END marker.
    - `vocab`: the number of token ids the table covers (ids at or past it, `end_id` and
      `eos_id` are never allowed).
    - `end_id`: the id of the END pseudo-token.
    - `eos_id`: the end-of-sequence id the index's `Vocabulary` was built with.

    **Returns:** `(automaton, state_ids)`: `state_ids[k]` is the index's id of the
    automaton's state `k` (`state_ids[0]` its initial state).

    Raises `ValueError` when no accepting state can be reached from the start: the
    tokenizer cannot write any text the constraint accepts.
    """
    initial = index.get_initial_state()
    src, tok, dst = _edges(index.get_transitions())
    # END may also be a character of the text (inside `.*` or a JSON string): a state
    # accepts where END leads to a state where the index's regex matches.
    ends = (tok == end_id) & np.isin(dst, np.asarray(list(index.get_final_states()), np.int64))
    finals = np.unique(src[ends])
    keep = (tok != eos_id) & (tok != end_id) & (tok < vocab) & (tok >= 0)
    src, tok, dst = src[keep], tok[keep], dst[keep]
    # Dense ids over every state the index names, to find the live ones.
    ids = np.unique(np.concatenate([src, dst, finals, [initial]]))
    s, d = np.searchsorted(ids, src), np.searchsorted(ids, dst)
    reachable = _closure(np.searchsorted(ids, [initial]), s, d, ids.size)
    productive = _closure(np.searchsorted(ids, finals), d, s, ids.size)
    live = reachable & productive
    if not live[np.searchsorted(ids, initial)]:
        raise ValueError(
            "the constraint accepts no text this tokenizer can write (no accepting state "
            "can be reached from the start): check the pattern or schema against the vocabulary."
        )
    ids = np.concatenate([[initial], ids[live & (ids != initial)]])
    # `renumber[k]` for the index state `ids_sorted[k]`.
    order = np.argsort(ids, kind="stable")
    ids_sorted = ids[order]

    def dense(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        at = np.minimum(np.searchsorted(ids_sorted, x), ids.size - 1)
        return order[at], ids_sorted[at] == x

    s, s_ok = dense(src)
    d, d_ok = dense(dst)
    keep = s_ok & d_ok
    s, t, d = s[keep], tok[keep], d[keep]
    n_states = ids.size
    words = -(-vocab // 32)

    # One bit per (state, token) pair; the pairs are unique, so summing the bits ORs them.
    flat = s * words + (t >> 5)
    bits = np.bincount(flat, weights=np.left_shift(1, t & 31).astype(np.float64), minlength=n_states * words)
    allowed = bits.astype(np.uint64).astype(np.uint32).reshape(n_states, words)

    # The most common next state of each state (ties: the lowest id); itself without tokens.
    pairs, counts = np.unique(s * n_states + d, return_counts=True)
    pair_state, pair_next = pairs // n_states, pairs % n_states
    best = np.lexsort((pair_next, -counts, pair_state))
    first = np.ones(best.size, bool)
    first[1:] = pair_state[best][1:] != pair_state[best][:-1]
    default_next = np.arange(n_states, dtype=np.int64)
    default_next[pair_state[best][first]] = pair_next[best][first]

    exception = d != default_next[s]
    es, et, en = s[exception], t[exception], d[exception]
    by = np.lexsort((et, es))
    es, et, en = es[by], et[by], en[by]
    exc_start = np.concatenate([[0], np.cumsum(np.bincount(es, minlength=n_states))])

    accepting = np.isin(ids, finals)
    automaton = Automaton(
        allowed=allowed,
        default_next=default_next.astype(np.int32),
        exc_start=exc_start.astype(np.int32),
        exc_token=et.astype(np.int32),
        exc_next=en.astype(np.int32),
        accepting=accepting,
        vocab=int(vocab),
    )
    return automaton, ids
