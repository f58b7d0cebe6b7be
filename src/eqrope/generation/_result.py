"""What a generate program returns, and the `eqrope.Generation` the caller gets.

Every program (plain, speculative, uncached) returns an `Outputs` of `(rows, max_len)`
buffers; `finish` cuts them to the call's width and shapes them for the caller.
"""

import dataclasses
from typing import NamedTuple

import equinox as eqx
import jax
import numpy as np
from jaxtyping import Array, Float, Int

from .._checks import is_concrete
from .._upload import upload
from ._request import UNDER_JIT, Request


class Generation(eqx.Module):
    """The result of `generate(..., return_logprobs=True)`.

    - `tokens`: as returned by `generate` (prompt, new tokens, then `pad_id`).
    - `logprobs`: the log-probability of each generated token under the distribution it
      was sampled from, after every processor (penalties, `bad_ids` and `min_new` masks,
      temperature, top-k, top-p, min-p; greedy decoding: the softmax of the penalized and
      masked logits), at its position, and 0 at prompt and padding positions, so
      `logprobs.sum(-1)` is the log-probability of the generated text under the sampler.
    - `model_logprobs`: the same tokens' log-probabilities under the model's own
      distribution at the sampling temperature, `log_softmax(logits / temperature)`
      (temperature 1 when greedy), without penalties, masks or truncation; 0 elsewhere.
    - `lengths`: the number of valid tokens (prompt plus generated) of each row.
    - `target_steps`: how many times the model ran for each row after the prefill: one
      step per new token without a draft; with `draft=`, one per round, a round verifying
      `draft_len` drafted tokens in one pass.
    - `drafted`, `accepted`: the drafted tokens each row was offered and how many it
      kept; 0 without a draft. A round offers `draft_len` drafts, or as many tokens as
      the row may still add (`max_new`, the cache) when that is fewer, so a draft that
      always agrees with the model has every draft accepted.
    - `speculative`: whether a draft ran (`generate(..., draft=...)`); the counters
      `target_steps`, `drafted` and `accepted` are in the repr only then.

    With `num_samples`, each field has the samples' axis after the batch's.
    """

    tokens: Int[Array, "*batch total"]
    logprobs: Float[Array, "*batch total"]
    model_logprobs: Float[Array, "*batch total"]
    lengths: Int[Array, "*batch"]
    target_steps: Int[Array, "*batch"]
    drafted: Int[Array, "*batch"]
    accepted: Int[Array, "*batch"]
    speculative: bool = eqx.field(static=True, default=False)

    def __repr__(self) -> str:
        names = [f.name for f in dataclasses.fields(self)][: 7 if self.speculative else 4]
        fields = "".join(f"\n  {n}={eqx.tree_pformat(getattr(self, n))}," for n in names)
        return f"Generation({fields[:-1]}\n)"

    @property
    def acceptance(self) -> float:
        """The fraction of drafted tokens accepted, over every row (NaN without drafts)."""
        drafted = int(np.sum(np.asarray(self.drafted)))
        return int(np.sum(np.asarray(self.accepted))) / drafted if drafted else float("nan")


NON_FINITE = (
    "generate: the model gave non-finite logits (NaN or inf) for a row still generating, so "
    "every token after it would be garbage. Check the weights (a diverged training run, an "
    "overflow in a low-precision dtype) or pass check_finite=False to generate anyway."
)


class Outputs(NamedTuple):
    """A program's results: the `(rows, max_len)` buffers of the text and of each new
    token's two log-probabilities, each row's end, and, from the speculative program,
    the per-row counters `(target_steps, drafted, accepted)` (`None`: one model pass per
    new token, no drafts)."""

    tokens: object
    logprobs: object
    model_logprobs: object
    ends: object
    counters: tuple | None = None


def finish(request: Request, outputs: Outputs, return_logprobs: bool):
    """Cut the `(rows, max_len)` buffers to `total`, pad after each row's end, shape
    them `(*batch, *samples, total)`, and return the tokens or a [`eqrope.Generation`][].

    On the host: eager jnp ops would compile anew for every `total`. Under `jax.grad` the
    log-probabilities are tracers and are sliced with jnp.
    """
    tokens, logprobs, model_logprobs, ends, counters = outputs
    total = request.total
    ends = to_host(ends).astype(np.int32)
    inside = np.arange(total)[None, :] < ends[:, None]
    tokens = np.where(inside, np.asarray(tokens)[:, :total], request.pad_id).astype(np.int32)
    lead = (request.prompt.shape[0],) if request.batched else ()
    lead += (request.samples,) if request.samples is not None else ()
    tokens, ends = tokens.reshape(*lead, total), ends.reshape(lead)
    # `upload` (`jax.device_put`), not `jnp.asarray`, which compiles a program per shape.
    if not return_logprobs:
        return upload(tokens)
    # The log-probabilities are already 0 outside the generated positions.
    both = [
        (np.asarray(x)[:, :total] if is_concrete(x) else x[:, :total]).reshape(*lead, total)
        for x in (logprobs, model_logprobs)
    ]
    speculative = counters is not None
    if not speculative:  # one model pass per new token, no drafts
        new = ends - np.repeat(request.lengths, request.samples or 1).reshape(lead)
        counters = (new, np.zeros_like(new), np.zeros_like(new))
    counters = tuple(np.asarray(c, np.int32).reshape(lead) for c in counters)
    tokens, logprobs, model_logprobs, ends, counters = upload((tokens, *both, ends, counters))
    return Generation(tokens, logprobs, model_logprobs, ends, *counters, speculative=speculative)


def to_host(x) -> np.ndarray:
    """`np.asarray(x)`; a tracer here means `generate` was called under `jax.jit`."""
    try:
        return np.asarray(x)
    except jax.errors.TracerArrayConversionError:
        raise TypeError(UNDER_JIT.format(name="model")) from None
