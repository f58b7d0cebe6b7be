"""The text of a generation, as a value: each row's tokens, position and bookkeeping.

Both programs, the plain decode loop (`_decode.py`) and the speculative round
(`speculative/_round.py`), start a `TextState` here, check each step's logits and
`commit` their tokens with it, so a row ends by the same rules in both.
"""

import dataclasses
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ._processors import History, record
from ._sampling import Sampling, penalties_on, per_row
from ._stop_strings import ends_with_text, holds_text_stops, text_stops_on
from ._stopping import NONE, ends_with_stop, holds_stops
from ._stream import emit


class TextState(eqx.Module):
    """The text of each row of a batch, and the bookkeeping that comes with it.

    - `pos`: where each row's next token goes.
    - `n_new`: tokens generated so far per row.
    - `done`: rows that have stopped (EOS, a stop sequence, `max_new`, or the cache is
      full).
    - `history`: the ids each row has seen and how often it generated each (the
      penalties read it), updated with each token.
    - `tokens`, `logprobs`, `model_logprobs`: `(batch, max_len)` buffers of the text and
      of each new token's log-probabilities, as sampled and under the model (0 elsewhere).
    - `nonfinite`: rows stopped because their logits held a NaN or an infinity.
    """

    pos: Int[Array, " batch"]
    n_new: Int[Array, " batch"]
    done: Bool[Array, " batch"]
    history: History
    tokens: Int[Array, "batch max_len"]
    logprobs: Float[Array, "batch max_len"]
    model_logprobs: Float[Array, "batch max_len"]
    nonfinite: Bool[Array, " batch"]


def start_text(
    buffer: Int[Array, "batch max_len"], lengths: Int[Array, " batch"], history: History, max_new
) -> TextState:
    """The text state before the first new token: each row's prompt, nothing generated."""
    batch, max_len = buffer.shape
    zeros = functools.partial(jnp.zeros, dtype=jnp.float32)
    return TextState(
        pos=lengths,
        n_new=jnp.zeros((batch,), jnp.int32),
        done=(max_new <= 0) | (lengths >= max_len),
        history=history,
        tokens=buffer,
        logprobs=zeros((batch, max_len)),
        model_logprobs=zeros((batch, max_len)),
        nonfinite=jnp.zeros((batch,), jnp.bool_),
    )


def check_logits(text: TextState, logits: Float[Array, "batch vocab"], active: Bool[Array, " batch"]):
    """Stop and flag each `active` row whose logits hold a NaN or an infinity; the caller
    raises. **Returns:** `(text, active)` with those rows done and no longer active.

    The non-finite entries are counted as a float32 sum (any one makes it at least 1),
    not reduced as booleans: XLA:CPU runs a large float sum as one library kernel but
    splits a boolean reduction over a large vocabulary into a tree of four kernels, each
    compiled on the program's first call."""
    flags = jnp.where(jnp.isfinite(logits), jnp.float32(0), jnp.float32(1))
    bad = active & (jnp.sum(flags, axis=-1) > 0)
    text = dataclasses.replace(text, done=text.done | bad, nonfinite=text.nonfinite | bad)
    return text, active & ~bad


def commit(
    text: TextState, tok, lp, own, active: Bool[Array, " batch"], max_new, sampling: Sampling, listener
) -> TextState:
    """Write each `active` row's token `tok` (with its log-probabilities `lp` and `own`) at
    its `pos`, and advance the row; the other rows are unchanged.

    A row ends after an EOS id, a completed stop sequence or a stop string, once it has
    `min_new` new tokens before this one, after `max_new` new tokens, or when the cache is
    full.

    `sampling` holds the settings of every row, or of each row, with a leading rows axis
    on every field (`per_row`: the engine's slots, `generate`'s settings per row);
    `max_new` likewise.
    """
    batch, max_len = text.tokens.shape
    pos, rows = text.pos, jnp.arange(batch)

    def write(buffer, value):  # an inactive row's write falls outside the buffer: dropped
        return buffer.at[rows, jnp.where(active, pos, max_len)].set(value, mode="drop")

    tokens = write(text.tokens, tok)
    if listener is not None:
        emit(listener, tok, pos, active)
    n_new = text.n_new + active.astype(jnp.int32)
    each_row = per_row(sampling)
    eos = jnp.asarray(sampling.eos)
    is_eos = jnp.any(tok[:, None] == (eos if each_row else eos[None, :]), axis=-1)
    # A call without stop sequences or strings has tables of no rows: no matching is
    # traced. Otherwise settings-level branches (one predicate for every row): a call
    # without penalties, or whose table rows are spare, skips counting and matching.
    axis = 0 if each_row else None
    is_stop = jnp.zeros((batch,), jnp.bool_)
    if holds_stops(sampling.stop):
        is_stop = is_stop | jax.lax.cond(
            jnp.any(jnp.asarray(sampling.stop) != NONE),
            lambda: jax.vmap(ends_with_stop, in_axes=(0, 0, axis))(tokens, pos, sampling.stop),
            lambda: jnp.zeros((batch,), jnp.bool_),
        )
    if holds_text_stops(sampling.stop_text):
        is_stop = is_stop | jax.lax.cond(
            jnp.any(text_stops_on(sampling.stop_text)),
            lambda: jax.vmap(ends_with_text, in_axes=(0, 0, axis))(tokens, pos, sampling.stop_text),
            lambda: jnp.zeros((batch,), jnp.bool_),
        )
    may_end = text.n_new >= sampling.min_new
    ends = (may_end & (is_eos | is_stop)) | (n_new >= max_new) | (pos + 1 >= max_len)
    return TextState(
        pos=jnp.where(active, pos + 1, pos),
        n_new=n_new,
        done=text.done | (active & ends),
        history=jax.lax.cond(
            jnp.any(penalties_on(sampling)),
            lambda h: jax.vmap(record)(h, tok, active),
            lambda h: h,
            text.history,
        ),
        tokens=tokens,
        logprobs=write(text.logprobs, lp),
        model_logprobs=write(text.model_logprobs, own),
        nonfinite=text.nonfinite,
    )
