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
from ._rows import over_rows, repeat_rows, rows_cache


def prepare(model, buffer, lengths, chunk, samples, mesh=None, rules=None, differentiable=False):
    """The prefill of a generate program (`prefill_rows`): the batched cache, the float32
    logits at each row's last prompt token, and the prompts' histories, each repeated
    `samples` times (sample-minor) when given. **Returns:** `(cache, logits, buffer,
    lengths, history)`."""
    cache, logits = prefill_rows(model, buffer, lengths, chunk, mesh, rules, differentiable)
    history = jax.vmap(functools.partial(prompt_history, vocab=logits.shape[-1]))(buffer, lengths)
    if samples is None:
        return cache, logits, buffer, lengths, history
    # One prefill per prompt; its cache rows serve every sample.
    cache = repeat_rows(cache, samples, buffer.shape[0])
    repeat = functools.partial(jnp.repeat, repeats=samples, axis=0)
    logits, buffer, lengths, history = jax.tree.map(repeat, (logits, buffer, lengths, history))
    return constrain(cache, mesh, rules), logits, buffer, lengths, history


def prefill_piece(max_len: int) -> int:
    """The default prefill piece of a cache of `max_len` rows: a quarter of the cache,
    between 16 and 64 tokens (16 up to 64 rows, 32 at 128, 64 from 256 rows).

    One piece size per cache length keeps the program at one prefill form (each form is
    a whole copy of the model to compile). Short caches hold short prompts, which small
    pieces prefill without padding them to 64 tokens; long prompts take fewer, larger
    pieces, each reading the weights once.
    """
    return min(max(max_len // 4, 16), 64, max_len)


def prefill_rows(
    model, buffer, lengths, chunk: int, mesh=None, rules=None, differentiable: bool = False
) -> tuple[KVCache, Float[Array, "batch vocab"]]:
    """Prefill every row in chunks; only chunks that start before the longest prompt run:
    a `lax.while_loop`, or with `differentiable` (which a while loop cannot be) a
    `lax.scan` over every chunk whose later ones are skipped with a `lax.cond`.

    The last chunk starts at `max_len - chunk` at the latest, so no write is clamped; it
    may recompute rows an earlier chunk wrote, with the same tokens and positions.

    **Returns:** the cache of the rows (`_rows.rows_cache`: no batch axis for one row)
    and the float32 logits at each row's last prompt token.
    """
    batch, max_len = buffer.shape
    # One row holds its cache without a batch axis (see `_rows.py`).
    cache = constrain(rows_cache(model.init_cache(max_len=max_len), batch), mesh, rules)
    longest = jnp.max(lengths)

    def rows(size: int, start, carry):
        """Every row's `size` tokens from `start` (unbatched), and the logits at each
        row's last prompt token where it falls among them."""

        def row(ids, length, cache, last):
            piece = jax.lax.dynamic_slice(ids, (start,), (size,))
            index = length - 1 - start
            here = (index >= 0) & (index < size)
            # The head runs on the one row whose logits are kept (the largest product at
            # a large vocabulary), not on the whole piece.
            at = jnp.clip(index, 0, size - 1).astype(jnp.int32)[None]
            logits, cache = model.prefill(piece, cache, start, check=False, logits_at=at)
            last = jnp.where(here, logits[0].astype(last.dtype), last)
            return cache, last

        return over_rows(row, buffer, lengths, *carry)

    def run(j, carry):
        return rows(chunk, jnp.minimum(j * chunk, max_len - chunk).astype(jnp.int32), carry)

    carry = (cache, jnp.zeros((batch, model.vocab_size), jnp.float32))
    n_chunks = math.ceil(max_len / chunk)
    if n_chunks == 1:  # one piece, which always holds a prompt token
        return run(0, carry)
    if not differentiable:  # a loop over the chunks that hold a prompt token
        going = lambda state: state[0] * chunk < longest
        step = lambda state: (state[0] + 1, run(state[0], state[1]))
        return jax.lax.while_loop(going, step, (jnp.zeros((), jnp.int32), carry))[1]

    def body(carry, j):  # reverse-differentiable: every chunk, the later ones skipped
        return jax.lax.cond(j * chunk < longest, functools.partial(run, j), lambda c: c, carry), None

    return jax.lax.scan(body, carry, jnp.arange(n_chunks, dtype=jnp.int32))[0]
