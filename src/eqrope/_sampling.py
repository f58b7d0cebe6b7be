"""Choosing the next token from logits, with every setting a traced value."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int, Key, UInt


class Sampling(NamedTuple):
    """The sampling settings of one `generate` call, as scalar arrays.

    They are arguments of the compiled program, not constants, so changing any of them
    never recompiles. [`eqrope.generate`][] builds this record after checking its
    arguments (`eqrope._generate_args`). It is a `NamedTuple` (a pytree), not an
    `eqx.Module`: it is built on every call, and a Module's construction costs tens of
    microseconds, a visible part of a small model's generation.

    - `temperature`: 0 is greedy.
    - `top_k`: keep the logits `>=` the k-th largest (`top_k >= vocab` keeps everything).
    - `top_p`: nucleus mass (1 keeps everything).
    - `eos`: the end-of-sequence ids, `(n_eos,)`; `[-1]` for none. Their number is part
      of the program's shape; their values are traced.
    """

    temperature: Float[ArrayLike, ""]
    top_k: Int[ArrayLike, ""]
    top_p: Float[ArrayLike, ""]
    eos: Int[ArrayLike, " n_eos"]


def sample_token(
    logits: Float[Array, " vocab"],
    key: UInt[Array, "2"] | Key[Array, ""],
    position: Int[Array, ""],
    sampling: Sampling,
) -> tuple[Int[Array, ""], Float[Array, ""]]:
    """Sample the token at `position` of a row whose key is `key`; `temperature == 0` is
    greedy.

    The draw uses `jax.random.fold_in(key, position)`, derived only when sampling: greedy
    decoding spends nothing on keys.

    Filtering works on the sorted logits with traced thresholds:

    - `top_k`: keep the logits `>=` the k-th largest (ties at the threshold are kept; a
      `top_k >= vocab` keeps everything);
    - `top_p`: then keep the smallest prefix of the sorted distribution whose mass reaches
      `top_p` (nucleus sampling, Holtzman et al. 2020); the top token is always kept.

    **Returns:** `(token, logprob)`. For `temperature > 0`, `logprob` is the token's
    log-probability under the distribution it was sampled from (scaled and filtered).
    For greedy decoding it is the log-probability under the model's own softmax.
    """
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[0]
    temperature, top_k, top_p = sampling.temperature, sampling.top_k, sampling.top_p

    def greedy(_):
        token = jnp.argmax(logits).astype(jnp.int32)
        return token, jax.nn.log_softmax(logits)[token]

    def sample(_):
        scaled = logits / temperature.astype(jnp.float32)
        # One sort serves both filters: masking the sorted logits keeps them sorted.
        descending = jnp.sort(scaled)[::-1]
        kth = descending[jnp.clip(top_k, 1, vocab) - 1]
        descending = jnp.where(descending >= kth, descending, -jnp.inf)
        probs = jax.nn.softmax(descending)
        mass_before = jnp.cumsum(probs) - probs
        n_keep = jnp.sum(mass_before < top_p)
        threshold = descending[jnp.maximum(n_keep, 1) - 1]
        # With top_p = 1 rounding can count a masked (-inf) entry as kept; kth still holds.
        filtered = jnp.where(scaled >= jnp.maximum(kth, threshold), scaled, -jnp.inf)
        draw = jax.random.fold_in(key, position)
        token = jax.random.categorical(draw, filtered).astype(jnp.int32)
        return token, jax.nn.log_softmax(filtered)[token]

    # A real branch, not a select: greedy decoding skips the sort and the random draw.
    return jax.lax.cond(temperature > 0, sample, greedy, None)
