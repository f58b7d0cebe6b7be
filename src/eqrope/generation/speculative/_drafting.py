"""Drafting with a small model inside the compiled loop (what may draft is checked with
the rest of the call, in `eqrope.generation._request`).

A draft model keeps its own cache in the loop's state. Between rounds it holds the rows
of every position before the text's last two: each round feeds it those two tokens in one
pass (rewriting the first, which it may already hold), then one step per drafted token
but the last, so a round of `draft_len` drafts costs `draft_len` draft passes.
"""

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, Key

from ...model import KVCache
from .._processors import History, record
from .._rows import over_rows
from .._sampling import Sampling, draw, process_logits


def model_drafts(
    draft,
    cache: KVCache,
    tokens: Int[Array, "batch max_len"],
    pos: Int[Array, " batch"],
    history: History,
    n_new: Int[Array, " batch"],
    keys: Key[Array, " batch"],
    sampling: Sampling,
    draft_len: int,
) -> tuple[
    Int[Array, "batch draft_len"], Float[Array, "batch draft_len vocab"], KVCache, Bool[Array, " batch"]
]:
    """Draft `draft_len` tokens per row at `pos ..` with the draft model.

    Each drafted token is drawn (`eqrope.generation._sampling.draw`) from the draft's logits after
    the processors of the call, with the history of the tokens drafted before it, and the
    row's key at its position.

    **Returns:** `(drafts, logq, cache, nonfinite)`: the tokens, the log-probabilities
    each was drawn from, the draft's cache, and the rows whose draft logits were not finite.
    """
    max_len = tokens.shape[1]
    # The draft cache has `max_len` rows (it is prefilled from the same buffer) and a
    # row's `pos` never passes `max_len`, so the write of rows `start, start + 1` ends at
    # `max(pos, 2)`: within the cache for `pos >= 2`, and for `pos < 2` whenever the cache
    # has two rows. An invariant of the round, not a guard at the write.
    start = jnp.maximum(pos - 2, 0)
    pair = jax.vmap(lambda row, s: jax.lax.dynamic_slice(row, (s,), (2,)))(tokens, start)
    feed = functools.partial(draft.prefill, check=False, kv_bound=jnp.max(start), kv_low=jnp.min(start))
    logits, cache = over_rows(feed, pair, cache, start)
    logits = jnp.take_along_axis(logits, jnp.clip(pos - 1 - start, 0, 1)[:, None, None], axis=1)[:, 0]
    choose = jax.vmap(draw, in_axes=(0, 0, 0, None))

    def one(logits, history, i):
        logits = logits.astype(jnp.float32)
        processed = jax.vmap(process_logits, in_axes=(0, 0, 0, None))(logits, history, n_new + i, sampling)
        token, logq = choose(processed, keys, pos + i, sampling)
        history = jax.vmap(record)(history, token, jnp.ones(token.shape, jnp.bool_))
        return token, logq, history, ~jnp.all(jnp.isfinite(logits), axis=-1)

    def body(carry, i):
        cache, logits, history = carry
        token, logq, history, bad = one(logits, history, i)
        step_pos = jnp.minimum(pos + i, max_len - 1)
        step = functools.partial(
            draft.step, check=False, kv_bound=jnp.max(step_pos), kv_low=jnp.min(step_pos)
        )
        logits, cache = over_rows(step, token, cache, step_pos)
        return (cache, logits, history), (token, logq, bad)

    steps = jnp.arange(draft_len - 1, dtype=jnp.int32)
    (cache, logits, history), (tokens_, logqs, bads) = jax.lax.scan(body, (cache, logits, history), steps)
    last, last_logq, _, last_bad = one(logits, history, draft_len - 1)
    drafts = jnp.concatenate([tokens_.T, last[:, None]], axis=1)
    logq = jnp.concatenate([jnp.moveaxis(logqs, 0, 1), last_logq[:, None]], axis=1)
    nonfinite = jnp.any(bads, axis=0) | last_bad
    return drafts, logq, cache, nonfinite
