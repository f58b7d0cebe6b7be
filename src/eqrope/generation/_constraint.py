"""Structured output inside the compiled loop: each row carries the state of an automaton
over token ids, its logits are masked to that state's allowed tokens, and the sampled
token moves it on.

The automata of a call (`eqrope.generation._automaton.Automaton`, one per prompt or
none) are merged on the host into one `ConstraintTable` (`_constraint_table.py`): a
padded pytree of arrays whose sizes are capacity buckets, so a new schema within the
capacity is a new traced value, not a new program. Its state 0 is FREE: every token is
allowed, it accepts, and every token leads back to it, so a row without a constraint
passes through untouched (its tokens and log-probabilities are bitwise those of a call
without `constraint`, with the same key).

Each step, before every other processor (`_sampling.process_logits`):

- the row's allowed tokens are the bits of `allowed[state]`, except its EOS ids, which
  are allowed exactly when the state is accepting; every other logit becomes `-inf`, so
  the log-probabilities `generate` returns are those of the constrained distribution;
- a row with no token left (no allowed token, or only ones that `bad_ids`, or `min_new`
  holding EOS back, remove) is *stuck*: it ends there with nothing added, as a row with
  non-finite logits does, but is not flagged; nothing reads `-inf`-only logits, so
  nothing turns into a NaN;
- after the token, the row's next state is the exception of `(state, token)` when it
  has one (a binary search in `exc_token[exc_start[s] : exc_start[s + 1]]`, with a fixed
  number of iterations: the bits of the exceptions' capacity), else `default_next[state]`.

A call with no constraint at all passes `None` instead of a table, and runs the program
of a call without this feature; a call with one runs the mask in a `lax.cond` on "any row
outside FREE", as the penalties do.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, Int, UInt

from ._processors import id_mask
from ._sampling import Sampling, per_row

FREE = 0  # the state of a row without a constraint


class ConstraintTable(NamedTuple):
    """Every automaton of a call in one table: the `Automaton` layout (see its docstring)
    with global state numbers, state 0 FREE, and each size padded to its capacity.

    - `allowed`: `uint32 (states, words)`, the allowed-token bits of each state.
    - `default_next`: `int32 (states,)`, the next state after a token without an exception.
    - `exc_start`: `int32 (states + 1,)`, where each state's exceptions start.
    - `exc_token`, `exc_next`: `int32 (exceptions,)`, each exception's token (sorted
      within a state) and next state; spare entries hold 2^31 - 1 and 0.
    - `accepting`: `bool (states,)`, where a row may end (with an EOS id).

    Spare states allow nothing, accept nothing and have no exception.
    """

    allowed: UInt[ArrayLike, "states words"]
    default_next: Int[ArrayLike, " states"]
    exc_start: Int[ArrayLike, " states_1"]
    exc_token: Int[ArrayLike, " exceptions"]
    exc_next: Int[ArrayLike, " exceptions"]
    accepting: Bool[ArrayLike, " states"]


class Constraint(NamedTuple):
    """The constraint of a `generate` call, as a traced argument: the merged `table`, and
    each decoded row's start state, `(rows,)` (sample-minor, as the rows are): `FREE`,
    an automaton's start, or the first state of its THINK chain."""

    table: ConstraintTable
    start: Int[ArrayLike, " rows"]


def capacity(table: ConstraintTable) -> tuple[int, int]:
    """The table's `(states, exceptions)` capacity: part of the program's shape."""
    return jnp.shape(table.default_next)[0], jnp.shape(table.exc_token)[0]


def allowed_tokens(words: UInt[Array, " words"], vocab: int) -> Bool[Array, " vocab"]:
    """The bits of one state's `allowed` row, unpacked: bit `t % 32` of word `t // 32`."""
    shifts = jnp.arange(32, dtype=jnp.uint32)
    bits = (words[:, None] >> shifts[None, :]) & jnp.uint32(1)
    return bits.reshape(-1)[:vocab] != 0


def _row_mask(words, accepting, n_new, eos, bad, min_new, *, vocab: int):
    """One row's allowed tokens (EOS exactly when `accepting`), and whether no token is
    left once `bad` ids and the EOS ids held back by `min_new` are removed."""
    is_eos = id_mask(eos, vocab)
    allowed = jnp.where(is_eos, accepting, allowed_tokens(words, vocab))
    banned = id_mask(bad, vocab) | (is_eos & (n_new < min_new))
    return allowed, ~jnp.any(allowed & ~banned)


def constrain_logits(
    table: ConstraintTable,
    states: Int[Array, " batch"],
    logits: Float[Array, "batch vocab"],
    n_new: Int[Array, " batch"],
    sampling: Sampling,
) -> tuple[Float[Array, "batch vocab"], Bool[Array, " batch"]]:
    """Mask each row's logits to its state's allowed tokens (see the module's docstring).

    **Returns:** `(logits, stuck)`: the masked logits (a stuck row's are left as they
    were, so nothing downstream meets `-inf` alone), and the rows with no token left.
    """
    batch, vocab = logits.shape

    def masked(logits):
        axis = 0 if per_row(sampling) else None
        mask = jax.vmap(
            lambda *a: _row_mask(*a, vocab=vocab), in_axes=(0, 0, 0, axis, axis, axis)
        )
        words = jnp.asarray(table.allowed)[states]
        accepting = jnp.asarray(table.accepting)[states]
        allowed, stuck = mask(words, accepting, n_new, sampling.eos, sampling.bad, sampling.min_new)
        keep = allowed | stuck[:, None]
        return jnp.where(keep, logits, -jnp.inf), stuck

    def free(logits):
        return logits, jnp.zeros((batch,), jnp.bool_)

    return jax.lax.cond(jnp.any(states != FREE), masked, free, logits)


def advance(
    table: ConstraintTable,
    states: Int[Array, " batch"],
    tokens: Int[Array, " batch"],
    active: Bool[Array, " batch"],
) -> Int[Array, " batch"]:
    """Each `active` row's state after its token: the exception of `(state, token)` if
    there is one, else `default_next[state]`; the other rows keep theirs."""
    exc_start, exc_token = jnp.asarray(table.exc_start), jnp.asarray(table.exc_token)
    size = exc_token.shape[0]

    def moved(states):
        first, end = exc_start[states], exc_start[states + 1]

        def halve(_, bounds):  # the first exception whose token is >= the row's token
            lo, hi = bounds
            mid = (lo + hi) // 2
            below = (lo < hi) & (exc_token[jnp.clip(mid, 0, size - 1)] < tokens)
            return jnp.where(below, mid + 1, lo), jnp.where(below | (lo >= hi), hi, mid)

        lo, _ = jax.lax.fori_loop(0, size.bit_length() + 1, halve, (first, end))
        at = jnp.clip(lo, 0, size - 1)
        found = (lo < end) & (exc_token[at] == tokens)
        following = jnp.where(found, jnp.asarray(table.exc_next)[at], jnp.asarray(table.default_next)[states])
        return jnp.where(active, following, states).astype(states.dtype)

    return jax.lax.cond(jnp.any(states != FREE), moved, lambda s: s, states)
