"""`eqrope.generate`: check the call, run the cached program or the uncached loop, slice.

The pieces live beside it: the argument checks in `_generate_args.py`, the cached
program and its loop state in `_decode.py`, the uncached reference loop in `_uncached.py`,
and token sampling in `_sampling.py`.
"""

from collections.abc import Sequence

import equinox as eqx
import jax
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int

from ._checks import check_int, is_concrete
from ._decode import NON_FINITE, generate_cached
from ._generate_args import UNDER_JIT, Request, has_cache_protocol, parse_request
from ._sharding import shard_batch
from ._uncached import generate_uncached


class Generation(eqx.Module):
    """The result of `generate(..., return_logprobs=True)`.

    - `tokens`: as returned by `generate` (prompt, new tokens, then `pad_id`).
    - `logprobs`: the log-probability of each generated token at its position, and 0 at
      prompt and padding positions, so `logprobs.sum(-1)` is the log-probability of the
      generated text.
    - `lengths`: the number of valid tokens (prompt plus generated) of each row.
    """

    tokens: Int[Array, "*batch total"]
    logprobs: Float[Array, "*batch total"]
    lengths: Int[Array, "*batch"]


def generate(
    model,
    prompt,
    max_new: int,
    *,
    max_len: int | None = None,
    temperature: float | ArrayLike = 0.0,
    top_k: int | None = None,
    top_p: float | ArrayLike | None = None,
    key=None,
    eos_id: int | Sequence[int] | None = None,
    prompt_lengths=None,
    pad_id: int | None = None,
    return_logprobs: bool = False,
    check_finite: bool = True,
    prefill_chunk: int = 64,
    mesh=None,
    rules=None,
):
    """Generate up to `max_new` tokens after `prompt`.

    **Arguments:**

    - `model`: a model with the cache protocol (`init_cache`, `prefill`, `step`, such as
      [`eqrope.RotaryDecoder`][]) takes the cached path: one compiled program that prefills
      the prompt in chunks and decodes in a `jax.lax.while_loop` that stops with the last
      row, the cache in its state (a `jax.lax.scan` under `jax.grad`). Any
      other causal callable `ids -> logits` with a `max_len` attribute takes the uncached
      path: the whole text runs again for every new token, padded on the right to the next
      power of two so that it compiles once per bucket, not once per length
      ([`eqrope.testing.Uncached`][] wraps a decoder so).
    - `prompt`: `(seq,)` token ids, or `(batch, seq)` for a batch.
    - `max_new`: the most tokens to add. Generation also stops when the text fills the
      cache (`max_len` positions), and, per row, after an `eos_id`.
    - `max_len`: the cache rows of this call, at most the model's `max_len`. The program
      compiles once per value. `None` picks the smallest power of two (at least 16) that
      holds the prompt and `max_new` tokens, capped at the model's `max_len`, so a short
      job on a model built for 131072 positions allocates a short cache; a new power of
      two compiles a new program. `max_len=model.max_len` pins one program for every
      call (and lets generation run to the model's last position).
    - `temperature`, `top_k`, `top_p`: sampling; `temperature=0` is greedy. These are traced
      values: changing them does not recompile.
    - `key`: a PRNG key, needed when `temperature > 0`. The token at position `t` of a row
      is sampled with `jax.random.fold_in(row_key, t)`, where `row_key = key` for a 1-D
      prompt and `jax.random.split(key, batch)[i]` for row `i` of a batch, so row `i`
      equals `generate(model, prompt[i, :prompt_lengths[i]], ..., key=row_key)`.
    - `eos_id`: a row ends after this token, or after any of a sequence of tokens (the
      EOS token is kept). The ids are traced: a new list of the same length does not
      recompile.
    - `prompt_lengths`: for a batch, the real length of each row (ragged prompts, padded on
      the right); `None` means every row is full.
    - `pad_id`: fills positions after a row's end; default the (first) `eos_id`, else 0.
    - `return_logprobs`: return a [`eqrope.Generation`][] with log-probabilities.
    - `check_finite`: raise `FloatingPointError` if the model's logits for a row still
      generating hold a NaN or an infinity, instead of sampling garbage. Inside the
      compiled loop it costs one reduction per step: such a row stops and is flagged, and
      `generate` raises when the program returns. `False` skips the check.
    - `prefill_chunk`: the prompt is prefilled in chunks of this many tokens; only chunks
      that hold prompt tokens run.
    - `mesh`, `rules`: run a model placed with `eqrope.shard(model, mesh, rules)` on that
      device mesh (cached path only). The prompt rows, their lengths and keys are placed
      on the `batch` rule's mesh axis, and the cache is held with the sharding
      `eqrope.shard` gives a cache (by default batch on `"data"`, key/value heads on
      `"model"`); the results are replicated so every process can read them. The tokens
      are those of one device, and the program compiles once per mesh and rules.

    **Returns:** token ids of shape `(total,)` or `(batch, total)`, with
    `total = min(seq + max_new, max_len)` (the call's `max_len`; with the default it is
    `min(seq + max_new, model.max_len)`): each row holds its prompt (its first
    `prompt_lengths[i]` tokens), then its new tokens, then `pad_id` up to `total`.

    The cached path is differentiable: `jax.grad` of `generate(...).logprobs.sum()` with
    respect to the model's floating-point arrays gives the policy gradient of the sampled
    text (the tokens themselves are not differentiable).
    """
    request = parse_request(
        model,
        prompt,
        max_new,
        max_len=max_len,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        key=key,
        eos_id=eos_id,
        prompt_lengths=prompt_lengths,
        pad_id=pad_id,
    )
    if rules is not None and mesh is None:
        raise ValueError("rules say how to place arrays on a mesh; pass mesh= too.")
    if has_cache_protocol(model):
        chunk = check_int(prefill_chunk, "prefill_chunk", minimum=1)
        tokens, logprobs, ends, nonfinite = _run_cached(model, request, chunk, check_finite, mesh, rules)
        if _to_host(nonfinite):
            raise FloatingPointError(NON_FINITE)
    elif mesh is not None:
        raise ValueError("mesh is only for models with the cache protocol.")
    else:
        tokens, logprobs, ends = generate_uncached(model, request, check_finite)
    return _finish(request, tokens, logprobs, ends, return_logprobs)


def _run_cached(model, request: Request, chunk: int, check_finite, mesh, rules):
    batch, seq = request.prompt.shape
    buffer = np.zeros((batch, request.max_len), np.int32)
    buffer[:, :seq] = request.prompt
    lengths = request.lengths
    if mesh is not None:
        buffer, lengths = shard_batch((buffer, lengths), mesh, rules)
    # Under `jax.grad` the model's arrays are tracers: the loop must be a scan.
    differentiable = not all(map(is_concrete, jax.tree.leaves(model)))
    return generate_cached(
        model,
        buffer,
        lengths,
        np.asarray(request.max_new, np.int32),
        request.sampling,
        request.key,
        batched=request.batched,
        chunk=min(chunk, request.max_len),
        differentiable=differentiable,
        check_finite=bool(check_finite),
        mesh=mesh,
        rules=rules,
    )


def _finish(request: Request, tokens, logprobs, ends, return_logprobs: bool):
    """Cut the `(batch, max_len)` buffers to `total`, pad after each row's end, and
    return the tokens or a [`eqrope.Generation`][].

    On the host: eager jnp ops would compile anew for every `total`. Under `jax.grad` the
    log-probabilities are tracers and are sliced with jnp.
    """
    total = request.total
    ends = _to_host(ends).astype(np.int32)
    inside = np.arange(total)[None, :] < ends[:, None]
    tokens = np.where(inside, np.asarray(tokens)[:, :total], request.pad_id).astype(np.int32)
    if not request.batched:
        tokens, ends = tokens[0], ends[0]
    # `jax.device_put`, not `jnp.asarray`, which compiles a small program per shape.
    if not return_logprobs:
        return jax.device_put(tokens)
    # logprobs are already 0 outside the generated positions.
    logprobs = np.asarray(logprobs)[:, :total] if is_concrete(logprobs) else logprobs[:, :total]
    if not request.batched:
        logprobs = logprobs[0]
    tokens, logprobs, ends = jax.device_put((tokens, logprobs, ends))
    return Generation(tokens=tokens, logprobs=logprobs, lengths=ends)


def _to_host(x) -> np.ndarray:
    """`np.asarray(x)`; a tracer here means `generate` was called under `jax.jit`."""
    try:
        return np.asarray(x)
    except jax.errors.TracerArrayConversionError:
        raise TypeError(UNDER_JIT.format(name="model")) from None
