"""Logits processors: what happens to one row's logits between the model and the draw.

In transformers' order (`GenerationMixin._get_logits_processor`):

1. `penalize`: the repetition penalty (over the prompt and the generated tokens), then
   the presence and frequency penalties (over the generated tokens);
2. `suppress`: `bad_ids`, then the EOS ids while fewer than `min_new` tokens are new;
3. (when sampling) the temperature, then `truncate`: top-k, top-p, min-p.

Every setting is a traced value of `Sampling`, and each processor with its neutral
setting (penalty 1 or 0, no ids, `min_p` 0) returns its input bit for bit, so the
defaults give the tokens of a program without processors. The token history they read is
kept per row as a `History` (which ids were seen, how often each was generated), updated
with one scatter per token: nothing re-scans the text.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, Int


class History(NamedTuple):
    """The token history of one row (or, with a leading axis, of a batch).

    - `seen`: the ids in the prompt or among the generated tokens (repetition penalty).
    - `counts`: how often each id was generated (presence and frequency penalties).
    """

    seen: Bool[Array, "*batch vocab"]
    counts: Int[Array, "*batch vocab"]


def prompt_history(ids: Int[Array, " seq"], length: Int[ArrayLike, ""], vocab: int) -> History:
    """The history of a row whose prompt is `ids[:length]` (the rest is padding)."""
    real = jnp.arange(ids.shape[0], dtype=jnp.int32) < length
    seen = jnp.zeros((vocab,), jnp.bool_).at[jnp.where(real, ids, vocab)].set(True, mode="drop")
    return History(seen, jnp.zeros((vocab,), jnp.int32))


def record(history: History, token: Int[Array, ""], keep: Bool[Array, ""]) -> History:
    """`history` after `token`, if `keep` (a row still generating)."""
    vocab = history.seen.shape[0]
    token = jnp.where(keep, token, vocab)  # out of range: dropped
    return History(
        history.seen.at[token].set(True, mode="drop"),
        history.counts.at[token].add(1, mode="drop"),
    )


def id_mask(ids: Int[ArrayLike, " n"], vocab: int) -> Bool[Array, " vocab"]:
    """True at each id of `ids`; negative entries (padding) mark nothing."""
    ids = jnp.asarray(ids)
    return jnp.zeros((vocab,), jnp.bool_).at[jnp.where(ids >= 0, ids, vocab)].set(True, mode="drop")


def penalize(
    logits: Float[Array, " vocab"],
    history: History,
    repetition: Float[ArrayLike, ""],
    presence: Float[ArrayLike, ""],
    frequency: Float[ArrayLike, ""],
) -> Float[Array, " vocab"]:
    """The repetition penalty, then the presence and frequency penalties.

    - repetition (Keskar et al. 2019, as transformers' `RepetitionPenaltyLogitsProcessor`):
      the logit of a seen token is divided by `repetition` when positive and multiplied
      by it when negative;
    - presence and frequency (OpenAI's): `logit - frequency * count - presence * (count > 0)`,
      with `count` the times the token was generated (the prompt does not count).
    """
    dtype = logits.dtype
    p = jnp.asarray(repetition).astype(dtype)
    penalized = jnp.where(logits < 0, logits * p, logits / p)
    logits = jnp.where(history.seen, penalized, logits)
    counts = history.counts
    additive = counts.astype(dtype) * jnp.asarray(frequency).astype(dtype) + (counts > 0).astype(
        dtype
    ) * jnp.asarray(presence).astype(dtype)
    return logits - additive


def suppress(
    logits: Float[Array, " vocab"],
    n_new: Int[ArrayLike, ""],
    bad: Int[ArrayLike, " n_bad"],
    eos: Int[ArrayLike, " n_eos"],
    min_new: Int[ArrayLike, ""],
) -> Float[Array, " vocab"]:
    """`-inf` at the `bad` ids, and at the `eos` ids while `n_new < min_new`
    (transformers' `NoBadWordsLogitsProcessor` for single tokens, then
    `MinNewTokensLengthLogitsProcessor`)."""
    held = jnp.where(jnp.asarray(n_new) < min_new, jnp.asarray(eos), -1)  # -1 marks nothing
    banned = id_mask(jnp.concatenate([jnp.asarray(bad), held.astype(jnp.asarray(bad).dtype)]), logits.shape[0])
    return jnp.where(banned, -jnp.inf, logits)


def truncate(
    scaled: Float[Array, " vocab"],
    top_k: Int[ArrayLike, ""],
    top_p: Float[ArrayLike, ""],
    min_p: Float[ArrayLike, ""],
    sorts: Bool[ArrayLike, ""] | None = None,
) -> tuple[Float[Array, " vocab"], Float[Array, ""]]:
    """Top-k, then top-p, then min-p, on temperature-scaled logits; dropped tokens get `-inf`.
    **Returns:** the truncated logits and their largest (the top token's, which every
    filter keeps).

    - `top_k`: keep the logits `>=` the k-th largest (ties at the threshold are kept; a
      `top_k >= vocab` keeps everything);
    - `top_p`: then keep the smallest prefix of the sorted distribution whose mass reaches
      `top_p` (nucleus sampling, Holtzman et al. 2020); the top token is always kept, and
      `top_p = 1` keeps everything (transformers then skips the filter);
    - `min_p`: then drop the tokens whose probability (after the two filters above) is
      below `min_p` times the top token's (Nguyen et al. 2024); `min_p = 0` keeps all.
      The ratio of the two is `exp(logit - top logit)`, compared without normalizing.

    These are transformers' `TopKLogitsWarper`, `TopPLogitsWarper` and `MinPLogitsWarper`
    with `min_tokens_to_keep=1`, in the order `_get_logits_processor` applies them.

    Only top-k and top-p sort the vocabulary, so the sort runs in a `lax.cond` on
    `sorts`: whether any row of the call asks for either (default: this row's settings).
    Without them the cut is the lowest logit, which keeps everything, bit for bit as the
    sorted path does. Under `jax.vmap` pass the batch's `sorts` unbatched (`choose_rows`),
    or the branch becomes a select that sorts anyway.
    """
    vocab = scaled.shape[0]
    if sorts is None:
        sorts = needs_sort(top_k, top_p, vocab)
    filtered = jax.lax.cond(sorts, _top_k_top_p, _keep_all, scaled, top_k, top_p)
    top = jnp.max(filtered)
    kept = jnp.exp(filtered - top) >= jnp.asarray(min_p).astype(filtered.dtype)
    return jnp.where(kept, filtered, -jnp.inf), top


def needs_sort(top_k: Int[ArrayLike, "*rows"], top_p: Float[ArrayLike, "*rows"], vocab: int) -> Bool[Array, ""]:
    """Whether top-k or top-p drops anything for some row (`top_k < vocab`, `top_p < 1`):
    `truncate` sorts only then."""
    return jnp.any((jnp.asarray(top_k) < vocab) | (jnp.asarray(top_p) < 1))


def _top_k_top_p(scaled, top_k, top_p):
    vocab = scaled.shape[0]
    # One sort serves top-k and top-p: masking the sorted logits keeps them sorted.
    descending = jnp.sort(scaled)[::-1]
    kth = descending[jnp.clip(top_k, 1, vocab) - 1]
    descending = jnp.where(descending >= kth, descending, -jnp.inf)
    # `jax.nn.softmax`, bit for bit, whose max is the first entry (a NaN too: sorted last).
    unnormalized = jnp.exp(descending - jax.lax.stop_gradient(descending[0]))
    probs = unnormalized / jnp.sum(unnormalized)
    # The mass from each token down, summed from the smallest up as transformers does:
    # a token stays while the tokens below it hold more than 1 - top_p.
    mass_from = jnp.cumsum(probs[::-1])[::-1]
    top_p = jnp.asarray(top_p).astype(probs.dtype)
    # Counted as a float32 sum, exact below 2**24 entries: XLA:CPU compiles a large float
    # sum as one library kernel, an integer one as a tree of four kernels.
    ones = jnp.float32 if vocab < 2**24 else jnp.int32
    kept = jnp.sum(jnp.where(mass_from > 1 - top_p, ones(1), ones(0))).astype(jnp.int32)
    n_keep = jnp.where(top_p < 1, kept, vocab)
    threshold = descending[jnp.maximum(n_keep, 1) - 1]
    # A count past the top-k tokens reads a masked (-inf) entry; kth still holds.
    return jnp.where(scaled >= jnp.maximum(kth, threshold), scaled, -jnp.inf)


def _keep_all(scaled, top_k, top_p):
    # What the sorted path keeps with neither filter on: every logit at or above the last
    # sorted one, the lowest (JAX sorts NaNs last), so only a NaN becomes -inf.
    del top_k, top_p
    return jnp.where(jnp.isnan(scaled), -jnp.inf, scaled)
