"""The prefill of a generate program: every row's prompt into a batched cache, in chunks.

Shared by the plain and the speculative programs (the latter prefills its draft model too).
"""

import functools
import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from ..model import KVCache
from ..sharding._rules import constrain
from ._processors import prompt_history


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
