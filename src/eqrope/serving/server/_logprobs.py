"""The log-probabilities a completions API returns: each token's under the raw model, and
the most likely tokens at each position (OpenAI's and vLLM's `logprobs`).

vLLM's default (`"raw_logprobs"`) scores a token with `log_softmax` of the model's logits
at the position before it, before any sampling processor (temperature, top-k, penalties):
the same number `eqrope.score` gives. The server asks for it on the prompt (`echo` with
`logprobs`, lm-eval's `loglikelihood`) and on a generated completion, teacher-forced over
prompt + completion.

One compiled program per (length bucket, `max_k`): the sequence is padded on the right
to a power-of-two bucket (`eval._buckets.bucket`), the top `max_k` are taken on the
device, and a smaller `k` is a slice on the host, so neither a new length within a bucket
nor a new `k` compiles.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from ..._checks import as_int_array, check_int, check_vocab, is_concrete
from ..._custom_types import IntLike
from ..._log import compiling
from ...eval._buckets import bucket
from ...eval._plain import _logits
from ...generation._arrays import rebuild, split_model


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """What `token_logprobs` returns, as NumPy arrays on the host, one row per scored
    position `p = start .. n - 1`.

    - `logprobs`: `log p(ids[p] | ids[:p])` in float32.
    - `top_ids`: the `k` most likely tokens at `p`, most likely first (of tied tokens,
      the lower id first, as `jax.lax.top_k` orders them), int32.
    - `top_logprobs`: their log-probabilities, in float32.
    """

    logprobs: Float[np.ndarray, " scored"]
    top_ids: Int[np.ndarray, "scored k"]
    top_logprobs: Float[np.ndarray, "scored k"]


def token_logprobs(model, ids, start: IntLike, k: IntLike, *, max_k: IntLike) -> TokenLogprobs:
    """Each token's log-probability under `model` from position `start` on, and the `k`
    most likely tokens at each of those positions.

    **Arguments:**

    - `model`: an [`eqrope.RotaryDecoder`][] (or a causal model `ids (seq,) -> logits
      (seq, vocab)` with integer `max_len` and `vocab_size` attributes).
    - `ids`: `(n,)` token ids, a list or an integer array, `1 <= n <= model.max_len`, each
      in `[0, vocab_size)`.
    - `start`: the first position scored, `1 <= start <= n` (the first token has nothing
      before it; `start = n` scores nothing and runs nothing).
    - `k`: how many top tokens each position returns, `0 <= k <= max_k`.
    - `max_k`: the most top tokens any call asks for, `<= vocab_size`; static: the program
      computes the top `max_k` and `k` is a slice on the host, so a server that fixes
      `max_k` (OpenAI allows 5 for completions, 20 for chat) compiles once per length
      bucket whatever each request's `k`.

    **Returns:** a `TokenLogprobs` with `logprobs (n - start,)`, `top_ids (n - start, k)` and
    `top_logprobs (n - start, k)`. The log-probabilities are `logits - logsumexp(logits)` in
    float32 whatever the model's dtype, of the raw logits (no sampling processor).

    The forward pass reads `ids[: n - 1]` padded on the right to a power-of-two bucket (at
    least 16, at most `model.max_len`): one compiled program per (bucket, `max_k`).

    Raises `ValueError`, naming the argument, for an empty or too long `ids`, a token id
    outside the vocabulary, `start` outside `[1, n]`, `k` outside `[0, max_k]`, or `max_k`
    above the vocabulary; `TypeError` for non-integer arguments or a traced `ids`.
    """
    if not is_concrete(ids):
        raise TypeError(
            "token_logprobs got a traced ids: it pads and compiles on the host, so call it "
            "outside jax.jit, jax.vmap or eqx.filter_jit."
        )
    max_len, vocab = model.max_len, model.vocab_size
    ids = np.asarray(as_int_array(ids, "ids", ndim=1))
    n = ids.shape[0]
    if not 1 <= n <= max_len:
        raise ValueError(f"ids has {n} tokens; pass between 1 and the model's max_len={max_len}.")
    check_vocab(ids, vocab, "ids")
    start = check_int(start, "start", minimum=1)
    if start > n:
        raise ValueError(
            f"start={start} is past the end of ids ({n} tokens); pass 1 <= start <= {n}."
        )
    max_k = check_int(max_k, "max_k", minimum=0)
    if max_k > vocab:
        raise ValueError(
            f"max_k={max_k}, but the vocabulary has {vocab} ids; pass at most {vocab}."
        )
    k = check_int(k, "k", minimum=0)
    if k > max_k:
        raise ValueError(f"k={k} > max_k={max_k}; pass 0 <= k <= max_k, or a larger max_k.")
    scored = n - start
    if scored == 0:
        return TokenLogprobs(
            np.zeros((0,), np.float32), np.zeros((0, k), np.int32), np.zeros((0, k), np.float32)
        )
    # Position `i` of the pass reads `ids[i]` and predicts `ids[i + 1]`; `ids[n - 1]` is
    # only predicted, so the pass reads `n - 1` tokens, padded on the right with 0.
    width = bucket(n - 1, max_len)
    inputs = np.zeros((width,), np.int32)
    targets = np.zeros((width,), np.int32)
    inputs[: n - 1], targets[: n - 1] = ids[:-1], ids[1:]
    arrays, structure = split_model(model)
    chosen, top_values, top_ids = logprobs_program(
        arrays, inputs, targets, structure=structure, max_k=max_k
    )
    rows = slice(start - 1, n - 1)
    return TokenLogprobs(
        np.asarray(chosen)[rows],
        np.asarray(top_ids)[rows, :k].astype(np.int32),
        np.asarray(top_values)[rows, :k],
    )


@functools.partial(jax.jit, static_argnames=("structure", "max_k"))
def logprobs_program(
    arrays,
    inputs: Int[Array, " bucket"],
    targets: Int[Array, " bucket"],
    *,
    structure,
    max_k: int,
) -> tuple[Float[Array, " bucket"], Float[Array, "bucket max_k"], Int[Array, "bucket max_k"]]:
    """`log_softmax(logits)[targets]` at every position of one padded pass, and the top
    `max_k` log-probabilities and their ids, all in float32."""
    shapes = f"{inputs.shape[0]} tokens, top {max_k}"
    compiling("serving", "token logprobs", shapes, "length bucket or max_k")
    model = rebuild(arrays, structure)
    logits = _logits(model, inputs).astype(jnp.float32)
    logprobs = logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    chosen = jnp.take_along_axis(logprobs, targets[:, None], axis=-1)[:, 0]
    top_values, top_ids = jax.lax.top_k(logprobs, max_k)
    return chosen, top_values, top_ids
