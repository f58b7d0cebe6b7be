"""Speculative decoding as one compiled program: draft, verify, accept, in a while loop.

A round, for every row of the batch at once:

1. **Draft** `k` tokens after the text: with a small model (`_drafting.py`), whose cache
   is in the loop's state beside the target's, or by prompt lookup (`_prompt_lookup.py`).
2. **Verify**: one target pass over the text's last token and the `k` drafts gives the
   target's logits at the `k + 1` positions after the text. The pass writes their rows to
   the cache; rows of drafts that are then rejected need no rollback, since a row past a
   position is masked until it is written again.
3. **Accept** (`_acceptance.py`): position by position, keep each draft the rule accepts;
   at the first rejection the rule's token replaces it and the row's round ends. A row
   whose `k` drafts are all kept gains the target's own token at the position after them,
   so a round adds 1 to `k + 1` tokens per row, each row its own number.

Between rounds the target's cache holds every position of a row's text but the last
token, which the next verification feeds. The round's settings (`k`, the rule, the kind
of draft) are static; everything `generate` traces in the plain program is traced here
too, so the program compiles once per cache length and `k`.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int, Key

from ...model import KVCache
from .._arrays import for_decoding, rebuild, split_model
from .._compile_lines import compiling_generate
from .._prefill import prepare
from .._request import Request
from .._result import NON_FINITE, Outputs, to_host
from .._rows import over_rows
from .._sampling import Sampling, model_logprob, process_logits, row_keys
from .._state import TextState, check_logits, commit, start_text
from .._stream import streamed
from ._acceptance import judge
from ._drafting import model_drafts
from ._prompt_lookup import PromptLookup, lookup_drafts


class SpeculativeState(eqx.Module):
    """The carry of the speculative loop: the target's `cache` and the `draft_cache`
    (`None` for prompt lookup), the `text`, and per row the `rounds` it took part in
    (target passes), the drafts it was offered (`drafted`: `k` per round, fewer when
    fewer tokens may still be added) and `accepted`, and whether the draft's logits were
    ever non-finite (`draft_nonfinite`)."""

    cache: KVCache
    draft_cache: KVCache | None
    text: TextState
    rounds: Int[Array, " batch"]
    drafted: Int[Array, " batch"]
    accepted: Int[Array, " batch"]
    draft_nonfinite: Bool[Array, " batch"]


def speculate_cached(model, draft, *args, **static):
    """`speculative_program`, compiled, with both models' arrays as arguments."""
    arrays, structure = split_model((model, draft))
    return speculative_program(arrays, *args, structure=structure, **static)


@functools.partial(
    jax.jit,
    static_argnames=("structure", "batched", "chunk", "samples", "stream", "check_finite", "draft_len", "rule"),
)
def speculative_program(arrays, *args, structure, **static):
    compiling_generate("generate with a draft", arrays, structure, args, static)  # once per compile
    model, draft = rebuild(arrays, structure)
    return speculative_decode(model, draft, *args, **static)


def speculative_decode(
    model,
    draft,
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
    check_finite: bool = True,
    draft_len: int,
    rule: str,
):
    """Prefill the target (and a draft model), then speculate until every row is done.

    The arguments are `eqrope.generation._decode.decode_program`'s, with `draft` a model or a
    [`eqrope.PromptLookup`][], `draft_len` the drafts per round and `rule` the acceptance
    rule.

    **Returns:** `(tokens, logprobs, model_logprobs, ends, nonfinite, draft_nonfinite,
    rounds, drafted, accepted)`: `decode_program`'s five, whether any row met non-finite
    draft logits, and per row the rounds it took part in, the drafts it was offered and
    those it accepted.
    """
    keys = row_keys(key, buffer.shape[0], batched, samples)
    cache, _, prompts, ends, history = prepare(model, buffer, lengths, chunk, samples)
    model, cache = for_decoding(model, cache)
    draft_cache = None
    if not isinstance(draft, PromptLookup):
        draft, draft_cache = for_decoding(draft, prepare(draft, buffer, lengths, chunk, samples)[0])
    text = start_text(prompts, ends, history, max_new)
    rows = text.pos.shape[0]
    zeros = jnp.zeros((rows,), jnp.int32)
    state = SpeculativeState(cache, draft_cache, text, zeros, zeros, zeros, jnp.zeros((rows,), jnp.bool_))
    settings = (max_new, sampling, keys, stream_id if stream else None, check_finite, draft_len, rule)
    step = functools.partial(speculative_round, model, draft, *settings)
    state = jax.lax.while_loop(lambda s: jnp.any(~s.text.done), step, state)
    text = state.text
    return (
        text.tokens, text.logprobs, text.model_logprobs, text.pos, jnp.any(text.nonfinite),
        jnp.any(state.draft_nonfinite), state.rounds, state.drafted, state.accepted,
    )  # fmt: skip


def speculative_round(
    model, draft, max_new, sampling: Sampling, keys, listener, check_finite, draft_len, rule, state
) -> SpeculativeState:
    """Draft, verify and accept once for every row (see the module's docstring)."""
    text = state.text
    batch, max_len = text.tokens.shape
    k, pos = draft_len, text.pos
    active = ~text.done
    draft_cache, draft_nonfinite, logq = state.draft_cache, state.draft_nonfinite, None
    if isinstance(draft, PromptLookup):
        drafts = lookup_drafts(text.tokens, pos, k, draft)
    else:
        drafts, logq, draft_cache, bad = model_drafts(
            draft, draft_cache, text.tokens, pos, text.history, text.n_new, keys, sampling, k
        )
        if check_finite:
            draft_nonfinite = draft_nonfinite | (active & bad)
    logits, cache = _verify(model, state.cache, text.tokens, pos, drafts)
    # The target's logits for position `pos + i` are at `index + i` of the verified ones.
    index = pos - 1 - jnp.minimum(pos - 1, max_len - k - 1)
    rows = jnp.arange(batch)
    decide = functools.partial(judge, sampling=sampling, rule=rule)
    process = jax.vmap(process_logits, in_axes=(0, 0, 0, None))

    def position(carry, i):
        text, going, accepted = carry
        here = logits[rows, jnp.minimum(index + i, k)]
        going = going & ~text.done
        if check_finite:
            text, going = check_logits(text, here, going)
        is_draft = i < k
        slot = jnp.minimum(i, k - 1)
        q = None if logq is None else logq[:, slot]
        processed = process(here, text.history, text.n_new, sampling)
        if q is None:  # prompt lookup: a point mass at each draft
            judged = jax.vmap(functools.partial(decide, draft_logq=None, is_draft=is_draft))
            token, lp, kept = judged(processed, keys, text.pos, drafts[:, slot])
        else:
            judged = jax.vmap(functools.partial(decide, is_draft=is_draft))
            token, lp, kept = judged(processed, keys, text.pos, drafts[:, slot], q)
        own = jax.vmap(model_logprob, in_axes=(0, 0, None))(here, token, sampling)
        text = commit(text, token, lp, own, going, max_new, sampling, listener)
        accepted = accepted + (going & kept).astype(jnp.int32)
        return (text, going & kept, accepted), None

    carry = (text, active, state.accepted)
    (text, _, accepted), _ = jax.lax.scan(position, carry, jnp.arange(k + 1, dtype=jnp.int32))
    rounds = state.rounds + active.astype(jnp.int32)
    # Drafts that could be kept: no more than the tokens the row may still add.
    room = jnp.minimum(max_new - state.text.n_new, max_len - pos)
    drafted = state.drafted + jnp.where(active, jnp.clip(room, 0, k), 0).astype(jnp.int32)
    return SpeculativeState(cache, draft_cache, text, rounds, drafted, accepted, draft_nonfinite)


def _verify(model, cache: KVCache, tokens, pos, drafts):
    """One target pass over each row's last token and its drafts: positions `pos - 1 ..
    pos + k - 1`, started earlier near the cache's end (rewriting rows it already holds
    with the same tokens) so that no write is clamped.

    **Returns:** `(logits, cache)`, the float32 logits `(batch, k + 1, vocab)` of the pass.
    """
    batch, max_len = tokens.shape
    k = drafts.shape[1]
    rows = jnp.arange(batch)[:, None]
    columns = pos[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :]
    text = tokens.at[rows, columns].set(drafts, mode="drop")
    start = jnp.minimum(pos - 1, max_len - k - 1)
    ids = jax.vmap(lambda row, s: jax.lax.dynamic_slice(row, (s,), (k + 1,)))(text, start)
    run = functools.partial(model.prefill, check=False, kv_bound=jnp.max(start), kv_low=jnp.min(start))
    logits, cache = over_rows(run, ids, cache, start)
    return logits.astype(jnp.float32), cache


def run_speculative(model, request: Request) -> Outputs:
    """Run `speculative_program` for a checked `generate` call (its `on_token` listening).

    Raises `FloatingPointError` when a row met non-finite logits of the model or the draft.
    """

    def run(stream_id):
        return speculate_cached(
            model, request.draft, request.buffer(), request.lengths,
            request.new_tokens(), request.sampling, request.key, stream_id,
            batched=request.batched, chunk=request.chunk, samples=request.samples,
            stream=stream_id is not None, check_finite=request.check_finite,
            draft_len=request.draft_len, rule=request.accept,
        )  # fmt: skip

    tokens, logprobs, model_logprobs, ends, nonfinite, draft_nonfinite, *counters = streamed(
        run, request.stream
    )
    if to_host(nonfinite):
        raise FloatingPointError(NON_FINITE)
    if to_host(draft_nonfinite):
        raise FloatingPointError(DRAFT_NON_FINITE)
    return Outputs(tokens, logprobs, model_logprobs, ends, tuple(map(to_host, counters)))


DRAFT_NON_FINITE = (
    "generate: the draft model gave non-finite logits (NaN or inf) for a row still "
    "generating. Check the draft's weights, or pass check_finite=False: the text stays "
    "exact under greedy decoding, but the residual rule cannot judge a NaN draft."
)
