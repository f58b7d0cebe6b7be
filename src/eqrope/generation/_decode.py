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
import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, Key

from ..model._cache import KVCache
from ._processors import History, prompt_history, record
from ._sampling import Sampling, choose_token, row_keys
from ..sharding._rules import constrain
from ._stopping import ends_with_stop
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


class DecodeState(eqx.Module):
    """The carry of the decode loop: the batched [`eqrope.KVCache`][] (rows `0 .. pos - 1`
    of each row filled), the float32 `logits` for the token at each row's `pos`, and the
    `text`."""

    cache: KVCache
    logits: Float[Array, "batch vocab"]
    text: TextState


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
    raises. **Returns:** `(text, active)` with those rows done and no longer active."""
    bad = active & ~jnp.all(jnp.isfinite(logits), axis=-1)
    text = dataclasses.replace(text, done=text.done | bad, nonfinite=text.nonfinite | bad)
    return text, active & ~bad


def commit(
    text: TextState, tok, lp, own, active: Bool[Array, " batch"], max_new, sampling: Sampling, listener
) -> TextState:
    """Write each `active` row's token `tok` (with its log-probabilities `lp` and `own`) at
    its `pos`, and advance the row; the other rows are unchanged.

    A row ends after an EOS id or a completed stop sequence, once it has `min_new` new
    tokens before this one, after `max_new` new tokens, or when the cache is full.
    """
    batch, max_len = text.tokens.shape
    pos, rows = text.pos, jnp.arange(batch)

    def write(buffer, value):
        return buffer.at[rows, pos].set(jnp.where(active, value, buffer[rows, pos]))

    tokens = write(text.tokens, tok)
    if listener is not None:
        emit(listener, tok, pos, active)
    n_new = text.n_new + active.astype(jnp.int32)
    is_eos = jnp.any(tok[:, None] == sampling.eos[None, :], axis=-1)
    is_stop = jax.vmap(ends_with_stop, in_axes=(0, 0, None))(tokens, pos, sampling.stop)
    may_end = text.n_new >= sampling.min_new
    ends = (may_end & (is_eos | is_stop)) | (n_new >= max_new) | (pos + 1 >= max_len)
    return TextState(
        pos=jnp.where(active, pos + 1, pos),
        n_new=n_new,
        done=text.done | (active & ends),
        history=jax.vmap(record)(text.history, tok, active),
        tokens=tokens,
        logprobs=write(text.logprobs, lp),
        model_logprobs=write(text.model_logprobs, own),
        nonfinite=text.nonfinite,
    )


def split_model(model):
    """`(arrays, structure)` for a compiled program: when every leaf of `model` (any
    pytree) is an array, the flat leaves beside the (hashable) tree structure, skipping
    `eqx.partition`'s tree walks; otherwise `eqx.partition`'s two halves."""
    leaves, treedef = jax.tree.flatten(model)
    if all(isinstance(leaf, jax.Array) for leaf in leaves):
        return leaves, treedef
    return eqx.partition(model, eqx.is_array)


def rebuild(arrays, structure):
    """The model `split_model` split."""
    if isinstance(structure, jax.tree_util.PyTreeDef):
        return jax.tree.unflatten(structure, arrays)
    return eqx.combine(arrays, structure)


def generate_cached(model, *args, **static):
    """`decode_program`, compiled, called with the model's arrays as arguments.

    Like `eqx.filter_jit`, but cheaper per call for the small models whose generation is
    dominated by fixed costs (see `split_model`).
    """
    arrays, structure = split_model(model)
    return generate_program(arrays, *args, structure=structure, **static)


@functools.partial(
    jax.jit,
    static_argnames=(
        "structure", "batched", "chunk", "samples", "stream", "differentiable", "check_finite",
        "mesh", "rules",
    ),
)
def generate_program(arrays, *args, structure, **static):
    return decode_program(rebuild(arrays, structure), *args, **static)


def prepare(model, buffer, lengths, chunk, samples, mesh=None, rules=None):
    """The prefill of a generate program: the batched cache, the float32 logits at each
    row's last prompt token, and the prompts' histories, each repeated `samples` times
    (sample-minor) when given. **Returns:** `(cache, logits, buffer, lengths, history)`."""
    cache, logits = prefill_rows(model, buffer, lengths, chunk, mesh, rules)
    history = jax.vmap(functools.partial(prompt_history, vocab=logits.shape[-1]))(buffer, lengths)
    if samples is None:
        return cache, logits, buffer, lengths, history
    # One prefill per prompt; its cache rows serve every sample.
    repeat = functools.partial(jnp.repeat, repeats=samples, axis=0)
    cache, logits, buffer, lengths, history = jax.tree.map(
        repeat, (cache, logits, buffer, lengths, history)
    )
    return constrain(cache, mesh, rules), logits, buffer, lengths, history


def decode_program(
    model,
    buffer: Int[Array, "batch max_len"],
    lengths: Int[Array, " batch"],
    max_new: Int[Array, ""],
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
) -> tuple[
    Int[Array, "rows max_len"],
    Float[Array, "rows max_len"],
    Float[Array, "rows max_len"],
    Int[Array, " rows"],
    Bool[Array, ""],
]:
    """Prefill, then decode, as one program.

    `buffer` has one column per cache row. Row `i` samples with
    `fold_in(row_key_i, position)`, the keys of `eqrope.generation._sampling.row_keys`.
    `samples=n` prefills each prompt once and decodes `n` rows from it (`rows = batch *
    n`, sample-minor). `stream=True` calls the `on_token` listener `stream_id` (see
    `_stream.py`) with each step's new tokens. `differentiable=True` runs the
    loop as a scan (reverse-differentiable) instead of a while loop. `check_finite`
    stops a row whose logits hold a NaN or an infinity and flags it, at the cost of one
    reduction per step; the caller raises. With a `mesh`, the
    batched cache is pinned to the sharding `eqrope.shard` gives a cache, and the results
    are replicated.

    **Returns:** `(tokens, logprobs, model_logprobs, ends, nonfinite)`: the text buffer,
    the two log-probabilities of each new token (`eqrope.generation._sampling.choose_token`), each
    row's end (prompt plus generated tokens), and whether any row met non-finite logits.
    """
    keys = row_keys(key, buffer.shape[0], batched, samples)
    cache, logits, buffer, lengths, history = prepare(
        model, buffer, lengths, chunk, samples, mesh, rules
    )
    listener = stream_id if stream else None
    step = functools.partial(
        decode_step, model, max_new, sampling, keys, listener, check_finite, mesh, rules
    )
    text = start_text(buffer, lengths, history, max_new)
    state = DecodeState(cache=cache, logits=logits, text=text)
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


NON_FINITE = (
    "generate: the model gave non-finite logits (NaN or inf) for a row still generating, so "
    "every token after it would be garbage. Check the weights (a diverged training run, an "
    "overflow in a low-precision dtype) or pass check_finite=False to generate anyway."
)


def decode_step(
    model, max_new, sampling: Sampling, keys, listener, check_finite, mesh, rules, state: DecodeState
) -> DecodeState:
    """Sample each unfinished row's token at `pos` (`commit`), then run the model one step
    on it."""
    text = state.text
    max_len = text.tokens.shape[1]
    active = ~text.done
    if check_finite:  # a row with a NaN or an inf stops here, flagged, with nothing added
        text, active = check_logits(text, state.logits, active)
    choose = jax.vmap(choose_token, in_axes=(0, 0, 0, 0, 0, None))
    tok, lp, own = choose(state.logits, text.history, text.n_new, keys, text.pos, sampling)
    # Every iteration runs the step: when all rows have just finished it is wasted, but
    # skipping it with a `lax.cond` costs more, in every iteration, than it saves once.
    step_pos = jnp.minimum(text.pos, max_len - 1)
    text = commit(text, tok, lp, own, active, max_new, sampling, listener)
    # Unbatched bounds let every row skip the cache chunks past the batch's furthest
    # position, and with a sliding window those before its nearest position's window (a
    # batched one would make the skip a select).
    step = functools.partial(
        model.step, check=False, kv_bound=jnp.max(step_pos), kv_low=jnp.min(step_pos)
    )
    logits, cache = jax.vmap(step)(tok, state.cache, step_pos)
    cache, logits = constrain(cache, mesh, rules), logits.astype(jnp.float32)
    return DecodeState(cache=cache, logits=logits, text=text)


def prefill_rows(
    model, buffer, lengths, chunk: int, mesh=None, rules=None
) -> tuple[KVCache, Float[Array, "batch vocab"]]:
    """Prefill every row in chunks; only chunks that start before the longest prompt run.

    The last chunk starts at `max_len - chunk` at the latest, so no write is clamped; it
    may recompute rows an earlier chunk wrote, with the same tokens and positions.

    **Returns:** the batched cache and the float32 logits at each row's last prompt token.
    """
    batch, max_len = buffer.shape
    single = model.init_cache(max_len=max_len)
    cache = jax.tree.map(lambda x: jnp.broadcast_to(x, (batch, *x.shape)), single)
    cache = constrain(cache, mesh, rules)
    n_chunks = math.ceil(max_len / chunk)
    longest = jnp.max(lengths)

    def row(ids, length, cache, last, start):
        piece = jax.lax.dynamic_slice(ids, (start,), (chunk,))
        logits, cache = model.prefill(piece, cache, start, check=False)
        index = length - 1 - start
        here = (index >= 0) & (index < chunk)
        last = jnp.where(here, logits[jnp.clip(index, 0, chunk - 1)].astype(last.dtype), last)
        return cache, last

    def body(carry, j):
        start = jnp.minimum(j * chunk, max_len - chunk).astype(jnp.int32)

        def run(carry):
            cache, last = carry
            return jax.vmap(row, in_axes=(0, 0, 0, 0, None))(buffer, lengths, cache, last, start)

        return jax.lax.cond(j * chunk < longest, run, lambda c: c, carry), None

    last = jnp.zeros((batch, model.vocab_size), jnp.float32)
    (cache, last), _ = jax.lax.scan(body, (cache, last), jnp.arange(n_chunks, dtype=jnp.int32))
    return cache, last
