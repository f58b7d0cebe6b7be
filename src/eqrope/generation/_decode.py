"""The cached generate program: a chunked prefill, then one token per row per iteration.

It is one `eqx.filter_jit` program. The loop state is a `DecodeState`, a named
record like Gemma's `SamplingState`; everything but the shapes (the batch, the cache
length, the number of samples per prompt, the sizes of the EOS, banned and stop lists),
the prefill chunk, whether `on_token` streams, and the mesh is a traced argument, so a
new prompt, `max_new`, sampling setting, penalty, id list of the same size or key does
not recompile.

The loop is a `lax.while_loop` that stops when every row is done, so a job costs what
its tokens cost, whatever the cache length. A `while_loop` cannot be reverse-
differentiated, so when the model's arrays are being differentiated (`jax.grad` of the
log-probabilities) the loop is a `lax.scan` over the cache length instead, whose finished
iterations are skipped with a `lax.cond`.
"""

import dataclasses
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, Key

from ..model import KVCache
from ..sharding._rules import constrain, shard_batch
from ._arrays import for_decoding, model_facts, rebuild
from ._compile_lines import compiling_generate
from ._constraint import Constraint, advance, constrain_logits
from ._prefill import prepare
from ._request import Request
from ._result import NON_FINITE, Outputs, to_host
from ._rows import over_rows
from ._sampling import Sampling, choose_rows, choose_token, model_logprob, per_row, row_keys
from ._state import TextState, check_logits, commit, start_text
from ._stream import streamed


class DecodeState(eqx.Module):
    """The carry of the decode loop: the rows' [`eqrope.KVCache`][] (no batch axis for
    one row; rows `0 .. pos - 1` of each row filled), the float32 `logits` for the token
    at each row's `pos`, the `text`, and each row's `automaton` state (`_constraint.py`;
    `None` for a call without `constraint`)."""

    cache: KVCache
    logits: Float[Array, "batch vocab"]
    text: TextState
    automaton: Int[Array, " batch"] | None = None


def run_cached(model, request: Request) -> Outputs:
    """Run the plain program for a checked `generate` call (its `on_token` listening).

    Raises `FloatingPointError` when a row met non-finite logits (`check_finite`).
    """
    buffer, lengths = request.buffer(), request.lengths
    if request.mesh is not None:
        buffer, lengths = shard_batch((buffer, lengths), request.mesh, request.rules)

    def run(stream_id):
        return generate_cached(
            model, buffer, lengths, request.new_tokens(), request.sampling,
            request.key, stream_id, batched=request.batched, chunk=request.chunk,
            samples=request.samples, stream=stream_id is not None,
            differentiable=request.differentiable, check_finite=request.check_finite,
            mesh=request.mesh, rules=request.rules, constraint=request.constraint,
        )  # fmt: skip

    *outputs, nonfinite = streamed(run, request.stream)
    if to_host(nonfinite):
        raise FloatingPointError(NON_FINITE)
    return Outputs(*outputs)


def generate_cached(model, *args, **static):
    """`decode_program`, compiled, called with the model's arrays as arguments.

    Like `eqx.filter_jit`, but cheaper per call for the small models whose generation is
    dominated by fixed costs (see `_arrays.py`).
    """
    facts = model_facts(model)
    return generate_program(facts.arrays, *args, structure=facts.structure, **static)


@functools.partial(
    jax.jit,
    static_argnames=(
        "structure", "batched", "chunk", "samples", "stream", "differentiable", "check_finite",
        "mesh", "rules",
    ),
)
def generate_program(arrays, *args, structure, **static):
    compiling_generate("generate", arrays, structure, args, static)  # once per trace, that is per compile
    return decode_program(rebuild(arrays, structure), *args, **static)


def decode_program(
    model,
    buffer: Int[Array, "batch max_len"],
    lengths: Int[Array, " batch"],
    max_new: Int[Array, ""] | Int[Array, " rows"],
    sampling: Sampling,
    key: Key[Array, ""],
    stream_id: Int[Array, ""] | None = None,
    *,
    batched: bool,
    chunk: int,
    samples: int | None = None,
    stream: bool = False,
    differentiable: bool = False,
    check_finite: bool = True,
    mesh=None,
    rules=None,
    constraint: Constraint | None = None,
) -> tuple[
    Int[Array, "rows max_len"],
    Float[Array, "rows max_len"],
    Float[Array, "rows max_len"],
    Int[Array, " rows"],
    Bool[Array, ""],
]:
    """Prefill, then decode, as one program.

    `buffer` has one column per cache row. `max_new` is every row's or each row's
    (`generate` passes `(rows,)`), and `sampling` the settings of every row or, with a
    leading rows axis, each row's (`_sampling.per_row`: a different program, whose rows
    choose with `choose_rows`). Row `i` samples with
    `fold_in(row_key_i, position)`, the keys of `eqrope.generation._sampling.row_keys`.
    `samples=n` prefills each prompt once and decodes `n` rows from it (`rows = batch *
    n`, sample-minor). `stream=True` calls the `on_token` listener `stream_id` (see
    `_stream.py`) with each step's new tokens. `differentiable=True` runs the
    loop as a scan (reverse-differentiable) instead of a while loop. `check_finite`
    stops a row whose logits hold a NaN or an infinity and flags it, at the cost of one
    reduction per step; the caller raises. With a `mesh`, the
    batched cache is pinned to the sharding `eqrope.shard` gives a cache, and the results
    are replicated. `constraint` masks each row's logits with its automaton
    (`_constraint.py`); `None` leaves the program as it is without one.

    **Returns:** `(tokens, logprobs, model_logprobs, ends, nonfinite)`: the text buffer,
    the two log-probabilities of each new token (`eqrope.generation._sampling.choose_token`), each
    row's end (prompt plus generated tokens), and whether any row met non-finite logits.
    """
    keys = row_keys(key, buffer.shape[0], batched, samples)
    cache, logits, buffer, lengths, history = prepare(
        model, buffer, lengths, chunk, samples, mesh, rules, differentiable
    )
    model, cache = for_decoding(model, cache)
    cache = constrain(cache, mesh, rules)
    listener = stream_id if stream else None
    table = None if constraint is None else constraint.table
    step = functools.partial(
        decode_step, model, max_new, sampling, keys, listener, check_finite, mesh, rules, table
    )
    text = start_text(buffer, lengths, history, max_new)
    automaton = None if constraint is None else jnp.asarray(constraint.start, jnp.int32)
    state = DecodeState(cache=cache, logits=logits, text=text, automaton=automaton)
    if differentiable:

        def body(state: DecodeState, _):
            going = jnp.any(~state.text.done)
            return jax.lax.cond(going, step, lambda s: s, state), None

        state, _ = jax.lax.scan(body, state, None, length=buffer.shape[1] - 1)
    else:
        state = jax.lax.while_loop(lambda s: jnp.any(~s.text.done), step, state)
    text = state.text
    # Replicated (plain arrays under `constrain`), so every process can read them.
    outputs = (text.tokens, text.logprobs, text.model_logprobs, text.pos, jnp.any(text.nonfinite))
    return constrain(outputs, mesh, rules)


def decode_step(
    model, max_new, sampling: Sampling, keys, listener, check_finite, mesh, rules, table, state: DecodeState
) -> DecodeState:
    """Sample each unfinished row's token at `pos` (`commit`), then run the model one step
    on it. With a constraint `table`, the logits are masked first and the rows' automata
    move on with their tokens (`_constraint.py`)."""
    text, logits, automaton = state.text, state.logits, state.automaton
    max_len = text.tokens.shape[1]
    active = ~text.done
    if check_finite:  # a row with a NaN or an inf stops here, flagged, with nothing added
        text, active = check_logits(text, logits, active)
    if table is not None:  # a row with no token left stops here, with nothing added
        logits, stuck = constrain_logits(table, automaton, logits, text.n_new, sampling)
        text = dataclasses.replace(text, done=text.done | (active & stuck))
        active = active & ~stuck
    choose = choose_rows if per_row(sampling) else jax.vmap(choose_token, in_axes=(0, 0, 0, 0, 0, None))
    tok, lp, own = choose(logits, text.history, text.n_new, keys, text.pos, sampling)
    if table is not None:  # the model's own log-probability reads the unmasked logits
        own = jax.vmap(model_logprob, in_axes=(0, 0, 0 if per_row(sampling) else None))(state.logits, tok, sampling)
        automaton = advance(table, automaton, tok, active)
    # The step's write, row `step_pos` of the cache, cannot be clamped: `step_pos <=
    # max_len - 1`. A row at `pos == max_len` is done (its text is full); its step rewrites
    # its own last cache row, and its logits are never read again.
    step_pos = jnp.minimum(text.pos, max_len - 1)
    text = commit(text, tok, lp, own, active, max_new, sampling, listener)
    # Unbatched bounds let every row skip the cache chunks past the batch's furthest
    # position, and with a sliding window those before its nearest position's window (a
    # batched one would make the skip a select).
    step = functools.partial(
        model.step, check=False, kv_bound=jnp.max(step_pos), kv_low=jnp.min(step_pos)
    )
    def run(cache):
        logits, cache = over_rows(step, tok, cache, step_pos)
        return logits.astype(jnp.float32), cache

    # The last iteration's step (every row has just finished) is skipped: it is a whole
    # pass over the weights, which a one-token call (the time to the first token) would
    # pay twice. The branch costs about 1% of the seed's small steps.
    logits, cache = jax.lax.cond(jnp.any(~text.done), run, lambda cache: (state.logits, cache), state.cache)
    return DecodeState(cache=constrain(cache, mesh, rules), logits=logits, text=text, automaton=automaton)
