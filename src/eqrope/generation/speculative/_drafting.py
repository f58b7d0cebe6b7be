"""Drafts for speculative decoding: what may draft (checked on the host), and drafting with
a small model inside the compiled loop.

A draft model keeps its own cache in the loop's state. Between rounds it holds the rows
of every position before the text's last two: each round feeds it those two tokens in one
pass (rewriting the first, which it may already hold), then one step per drafted token
but the last, so a round of `draft_len` drafts costs `draft_len` draft passes.
"""

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, Key

from ._acceptance import RULES
from ...model._cache import KVCache
from ..._checks import check_int
from .._request import has_cache_protocol
from .._processors import History, record
from ._prompt_lookup import PromptLookup
from .._sampling import Sampling, draw, process_logits


def check_draft(model, draft, draft_len, accept, max_len: int):
    """The checked `(draft, draft_len, accept)` of a `generate` call whose cache has
    `max_len` rows: `draft` a model or a `PromptLookup` (`"prompt_lookup"` is the default
    one), or all three `None` when `draft` is `None`."""
    if draft is None:
        for name, value in (("draft_len", draft_len), ("accept", accept)):
            if value is not None:
                raise ValueError(
                    f"{name}={value!r} sets up speculative decoding, which needs a draft: "
                    "pass draft=a_small_model or draft='prompt_lookup' too."
                )
        return None, None, None
    if not has_cache_protocol(model):
        raise ValueError(
            "draft= speeds up the cached path; the model has no cache protocol (init_cache, "
            "prefill, step), so generate it without a draft."
        )
    if isinstance(draft, str):
        if draft != "prompt_lookup":
            raise ValueError(
                f"draft={draft!r}: the one named draft is 'prompt_lookup'; otherwise pass a "
                "model with the cache protocol, or eqrope.PromptLookup(...)."
            )
        draft = PromptLookup()
    elif not isinstance(draft, PromptLookup):
        _check_draft_model(model, draft, max_len)
    draft_len = check_int(4 if draft_len is None else draft_len, "draft_len", minimum=1)
    if draft_len + 1 > max_len:
        raise ValueError(
            f"draft_len={draft_len} verifies {draft_len + 1} positions at once, more than the "
            f"call's {max_len} cache rows; pass a smaller draft_len or a larger max_len."
        )
    accept = "residual" if accept is None else accept
    if accept not in RULES:
        raise ValueError(f"accept must be one of {RULES}, got {accept!r}.")
    return draft, draft_len, accept


def _check_draft_model(model, draft, max_len: int) -> None:
    if not has_cache_protocol(draft):
        raise TypeError(
            "draft must be a model with the cache protocol (init_cache, prefill, step), such "
            f"as a small eqrope.RotaryDecoder, or 'prompt_lookup'; got {type(draft).__name__}."
        )
    if draft.vocab_size != model.vocab_size:
        raise ValueError(
            f"the draft's vocab_size is {draft.vocab_size} but the model's is "
            f"{model.vocab_size}; a draft must share the model's vocabulary (its tokenizer)."
        )
    if draft.max_len < max_len:
        raise ValueError(
            f"the draft's max_len is {draft.max_len}, but this call's cache has {max_len} rows; "
            f"pass max_len <= {draft.max_len}, or use a draft built for more positions."
        )


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
    start = jnp.maximum(pos - 2, 0)
    pair = jax.vmap(lambda row, s: jax.lax.dynamic_slice(row, (s,), (2,)))(tokens, start)
    feed = functools.partial(draft.prefill, check=False, kv_bound=jnp.max(start), kv_low=jnp.min(start))
    logits, cache = jax.vmap(feed)(pair, cache, start)
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
        logits, cache = jax.vmap(step)(token, cache, step_pos)
        return (cache, logits, history), (token, logq, bad)

    steps = jnp.arange(draft_len - 1, dtype=jnp.int32)
    (cache, logits, history), (tokens_, logqs, bads) = jax.lax.scan(body, (cache, logits, history), steps)
    last, last_logq, _, last_bad = one(logits, history, draft_len - 1)
    drafts = jnp.concatenate([tokens_.T, last[:, None]], axis=1)
    logq = jnp.concatenate([jnp.moveaxis(logqs, 0, 1), last_logq[:, None]], axis=1)
    nonfinite = jnp.any(bads, axis=0) | last_bad
    return drafts, logq, cache, nonfinite
