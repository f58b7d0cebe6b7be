"""Autoregressive generation: one compiled program with the cache, or the uncached loop."""

import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from ._cache import KVCache
from ._checks import as_int_array, is_concrete
from ._sampling import sample_token
from ._sharding import constrain, shard_batch


# How many times the cached program has been traced (read by the tests). It grows by one
# per new `max_len`, model structure, batch size or `prefill_chunk`, and by nothing else.
_TRACES = 0


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


def has_cache_protocol(model) -> bool:
    """True for models with `init_cache`, `prefill` and `step` (like `RotaryDecoder`).

    `generate` calls `prefill(ids, cache, pos, check=False)` and `step(token, cache, pos,
    check=False, kv_bound=bound)` after checking the prompt itself.
    """
    return all(callable(getattr(model, name, None)) for name in ("init_cache", "prefill", "step"))


def generate(
    model,
    prompt,
    max_new: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    key=None,
    eos_id: int | None = None,
    prompt_lengths=None,
    pad_id: int | None = None,
    return_logprobs: bool = False,
    prefill_chunk: int = 64,
    mesh=None,
    rules=None,
):
    """Generate up to `max_new` tokens after `prompt`.

    **Arguments:**

    - `model`: a model with the cache protocol (`init_cache`, `prefill`, `step`, such as
      [`eqrope.RotaryDecoder`][]) takes the cached path: one compiled program that prefills
      the prompt in chunks and decodes in a `jax.lax.scan` with the cache in the carry. Any
      other causal callable `ids -> logits` with a `max_len` attribute takes the uncached
      path: the whole text runs again for every new token, padded on the right to the next
      power of two so that it compiles once per bucket, not once per length.
    - `prompt`: `(seq,)` token ids, or `(batch, seq)` for a batch.
    - `max_new`: the most tokens to add. Generation also stops when the text reaches the
      model's `max_len` (the cache has no more rows), and, per row, after `eos_id`.
    - `temperature`, `top_k`, `top_p`: sampling; `temperature=0` is greedy. These are traced
      values: changing them does not recompile.
    - `key`: a PRNG key, needed when `temperature > 0`. The token at position `t` of a row
      is sampled with `jax.random.fold_in(row_key, t)`, where `row_key = key` for a 1-D
      prompt and `jax.random.split(key, batch)[i]` for row `i` of a batch, so row `i`
      equals `generate(model, prompt[i, :prompt_lengths[i]], ..., key=row_key)`.
    - `prompt_lengths`: for a batch, the real length of each row (ragged prompts, padded on
      the right); `None` means every row is full.
    - `pad_id`: fills positions after a row's end; default `eos_id`, else 0.
    - `return_logprobs`: return a [`eqrope.Generation`][] with log-probabilities.
    - `prefill_chunk`: the prompt is prefilled in chunks of this many tokens; only chunks
      that hold prompt tokens run.
    - `mesh`, `rules`: run a model placed with `eqrope.shard(model, mesh, rules)` on that
      device mesh (cached path only). The prompt rows, their lengths and keys are placed
      on the `batch` rule's mesh axis, and the cache is held with the sharding
      `eqrope.shard` gives a cache (by default batch on `"data"`, key/value heads on
      `"model"`); the results are replicated so every process can read them. The tokens
      are those of one device, and the program compiles once per mesh and rules.

    **Returns:** token ids of shape `(total,)` or `(batch, total)`, with
    `total = min(seq + max_new, max_len)`: each row holds its prompt (its first
    `prompt_lengths[i]` tokens), then its new tokens, then `pad_id` up to `total`.

    The cached path is differentiable: `jax.grad` of `generate(...).logprobs.sum()` with
    respect to the model's floating-point arrays gives the policy gradient of the sampled
    text (the tokens themselves are not differentiable).
    """
    max_len = _max_len(model)
    vocab = getattr(model, "vocab_size", None)
    batched, prompt, lengths = _check_prompt(prompt, prompt_lengths, max_len, vocab)
    max_new = _check_max_new(max_new)
    temperature, top_k, top_p = _check_sampling(temperature, top_k, top_p, key, vocab)
    eos_id = _check_token_id(eos_id, "eos_id", vocab)
    pad_id = _check_token_id(pad_id, "pad_id", vocab)
    if pad_id is None:
        pad_id = 0 if eos_id is None else eos_id
    batch, seq = prompt.shape
    keys = _row_keys(key, batch, batched)
    settings = (
        jnp.asarray(temperature, jnp.float32),
        jnp.asarray(top_k, jnp.int32),
        jnp.asarray(top_p, jnp.float32),
    )
    eos = jnp.asarray(-1 if eos_id is None else eos_id, jnp.int32)

    if rules is not None and mesh is None:
        raise ValueError("rules say how to place arrays on a mesh; pass mesh= too.")
    if has_cache_protocol(model):
        if not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be a positive int, got {prefill_chunk!r}.")
        buffer = np.zeros((batch, max_len), np.int32)
        buffer[:, :seq] = np.asarray(prompt)
        if mesh is not None:
            buffer, lengths, keys = shard_batch((buffer, lengths, keys), mesh, rules)
        tokens, logprobs, ends = _generate_cached(
            model,
            buffer,
            lengths,
            jnp.asarray(max_new, jnp.int32),
            *settings,
            keys,
            eos,
            chunk=min(prefill_chunk, max_len),
            mesh=mesh,
            rules=rules,
        )
    elif mesh is not None:
        raise ValueError("mesh is only for models with the cache protocol.")
    else:
        tokens, logprobs, ends = _generate_uncached(
            model, prompt, lengths, max_new, *settings, keys, eos, max_len
        )

    # Host-side slicing: eager jnp ops would compile anew for every `total`.
    total = min(seq + max_new, max_len)
    ends = np.asarray(ends).astype(np.int32)
    inside = np.arange(total)[None, :] < ends[:, None]
    tokens = np.where(inside, np.asarray(tokens)[:, :total], pad_id).astype(np.int32)
    # logprobs are already 0 outside the generated positions; under `jax.grad` they are
    # tracers and are sliced with jnp.
    logprobs = np.asarray(logprobs)[:, :total] if is_concrete(logprobs) else logprobs[:, :total]
    if not batched:
        tokens, logprobs, ends = tokens[0], logprobs[0], ends[0]
    tokens, logprobs, ends = jnp.asarray(tokens), jnp.asarray(logprobs), jnp.asarray(ends)
    if return_logprobs:
        return Generation(tokens=tokens, logprobs=logprobs, lengths=ends)
    return tokens


# -- the cached path -----------------------------------------------------------------------


@eqx.filter_jit
def _generate_cached(
    model,
    buffer: Int[Array, "batch max_len"],
    lengths: Int[Array, " batch"],
    max_new: Int[Array, ""],
    temperature: Float[Array, ""],
    top_k: Int[Array, ""],
    top_p: Float[Array, ""],
    keys,
    eos: Int[Array, ""],
    *,
    chunk: int,
    mesh=None,
    rules=None,
):
    """Prefill, then decode, as one program. Everything but `chunk`, `mesh`, `rules` and
    shapes is traced. With a `mesh`, the batched cache is pinned to the sharding
    `eqrope.shard` gives a cache, and the results are replicated."""
    global _TRACES
    _TRACES += 1
    batch, max_len = buffer.shape
    cache, logits = _prefill(model, buffer, lengths, chunk, mesh, rules)

    def decode(carry):
        cache, logits, pos, n_new, done, tokens, logprobs = carry
        row_keys = jax.vmap(jax.random.fold_in)(keys, pos)
        tok, lp = jax.vmap(sample_token, in_axes=(0, 0, None, None, None))(
            logits, row_keys, temperature, top_k, top_p
        )
        rows = jnp.arange(batch)
        tokens = tokens.at[rows, pos].set(jnp.where(done, tokens[rows, pos], tok))
        logprobs = logprobs.at[rows, pos].set(jnp.where(done, logprobs[rows, pos], lp))
        n_new = n_new + jnp.where(done, 0, 1).astype(jnp.int32)
        finished = done | (tok == eos) | (n_new >= max_new) | (pos + 1 >= max_len)

        def advance(state):
            cache, _ = state
            step_pos = jnp.minimum(pos, max_len - 1)
            # An unbatched bound lets every row skip the cache chunks past the batch's
            # furthest position (a batched one would make the skip a select).
            step = functools.partial(model.step, check=False, kv_bound=jnp.max(step_pos))
            logits, cache = jax.vmap(step)(tok, cache, step_pos)
            return constrain(cache, mesh, rules), logits.astype(jnp.float32)

        cache, logits = jax.lax.cond(jnp.any(~finished), advance, lambda s: s, (cache, logits))
        pos = jnp.where(done, pos, pos + 1)
        return cache, logits, pos, n_new, finished, tokens, logprobs

    def body(carry, _):
        done = carry[4]
        return jax.lax.cond(jnp.any(~done), decode, lambda c: c, carry), None

    done = (max_new <= 0) | (lengths >= max_len)
    zeros = jnp.zeros((batch,), jnp.int32)
    carry = (cache, logits, lengths, zeros, done, buffer, jnp.zeros((batch, max_len), jnp.float32))
    carry, _ = jax.lax.scan(body, carry, None, length=max_len - 1)
    _, _, ends, _, _, tokens, logprobs = carry
    # Replicated (plain arrays under `constrain`), so every process can read them.
    return constrain((tokens, logprobs, ends), mesh, rules)


def _prefill(
    model, buffer, lengths, chunk: int, mesh=None, rules=None
) -> tuple[KVCache, Float[Array, "batch vocab"]]:
    """Prefill every row in chunks; only chunks that start before the longest prompt run.

    The last chunk starts at `max_len - chunk` at the latest, so no write is clamped; it
    may recompute rows an earlier chunk wrote, with the same tokens and positions.
    """
    batch, max_len = buffer.shape
    single = model.init_cache()
    cache = jax.tree.map(lambda x: jnp.broadcast_to(x, (batch, *x.shape)), single)
    cache = constrain(cache, mesh, rules)
    vocab = getattr(model, "vocab_size")
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

    last = jnp.zeros((batch, vocab), jnp.float32)
    (cache, last), _ = jax.lax.scan(body, (cache, last), jnp.arange(n_chunks, dtype=jnp.int32))
    return cache, last


# -- the uncached path ---------------------------------------------------------------------


@eqx.filter_jit
def _last_logits(model, ids, index):
    return model(ids)[index].astype(jnp.float32)


_sample = jax.jit(sample_token)


def uncached_bucket(length: int, max_len: int) -> int:
    """The padded width the uncached path runs a text of `length` tokens at.

    The next power of two (at least 16), capped at `max_len`: at most twice the text, and
    about `log2(max_len)` compiled shapes instead of one per length.
    """
    return min(max(16, 1 << (length - 1).bit_length()), max_len)


def _generate_uncached(model, prompt, lengths, max_new, temperature, top_k, top_p, keys, eos, max_len):
    """The reference loop: the whole text runs through `model` for every new token.

    The text is padded on the right to [`uncached_bucket`][] tokens; a causal model's
    logits at the last real token do not see the pads. Nothing is reused between tokens.
    """
    batch = prompt.shape[0]
    tokens = np.zeros((batch, max_len), np.int32)
    logprobs = np.zeros((batch, max_len), np.float32)
    ends = np.zeros((batch,), np.int32)
    prompt = np.asarray(prompt)
    lengths = np.asarray(lengths)
    for r in range(batch):
        text = [int(t) for t in prompt[r, : lengths[r]]]
        tokens[r, : len(text)] = text
        for _ in range(max_new):
            if len(text) >= max_len:
                break
            pos = len(text)
            padded = np.zeros((uncached_bucket(pos, max_len),), np.int32)
            padded[:pos] = text
            logits = _last_logits(model, jnp.asarray(padded), jnp.asarray(pos - 1, jnp.int32))
            tok, lp = _sample(logits, jax.random.fold_in(keys[r], pos), temperature, top_k, top_p)
            text.append(int(tok))
            tokens[r, pos], logprobs[r, pos] = int(tok), float(lp)
            if int(tok) == int(eos):
                break
        ends[r] = len(text)
    return jnp.asarray(tokens), jnp.asarray(logprobs), jnp.asarray(ends)


# -- argument checks -----------------------------------------------------------------------


def _max_len(model) -> int:
    max_len = getattr(model, "max_len", None)
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
        raise TypeError(
            "generate needs a model with an integer `max_len` attribute (and either the "
            f"cache protocol or `model(ids) -> logits`); got {type(model).__name__}."
        )
    return max_len


def _check_prompt(prompt, prompt_lengths, max_len, vocab):
    prompt = as_int_array(prompt, "prompt", ndim=(1, 2), hint=" Use (seq,) or (batch, seq).")
    batched = prompt.ndim == 2
    if not batched:
        if prompt_lengths is not None:
            raise ValueError("prompt_lengths is only for a batched (batch, seq) prompt.")
        prompt = prompt[None]
    batch, seq = prompt.shape
    if seq == 0 or batch == 0:
        raise ValueError(f"prompt is empty (shape {prompt.shape}); pass at least one token.")
    if seq > max_len:
        raise ValueError(
            f"prompt has {seq} tokens but the model's max_len is {max_len}; shorten it."
        )
    if prompt_lengths is None:
        lengths = np.full((batch,), seq, np.int32)
    else:
        lengths = as_int_array(prompt_lengths, "prompt_lengths", ndim=1)
        if lengths.shape[0] != batch:
            raise ValueError(
                f"prompt_lengths has {lengths.shape[0]} entries but prompt has {batch} rows."
            )
        bad = np.asarray((lengths < 1) | (lengths > seq))
        if bad.any():
            raise ValueError(
                f"prompt_lengths must be in [1, {seq}] (the prompt's width), got "
                f"{np.asarray(lengths).tolist()}."
            )
    if vocab is not None:
        real = np.arange(seq)[None, :] < np.asarray(lengths)[:, None]
        values = np.asarray(prompt)[real]
        bad = (values < 0) | (values >= vocab)
        if bad.any():
            raise ValueError(
                f"prompt holds token ids outside [0, {vocab}): {values[bad][:5].tolist()}."
            )
    return batched, prompt, lengths


def _check_token_id(value, name: str, vocab):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int token id or None, got {value!r}.")
    if value < 0 or (vocab is not None and value >= vocab):
        raise ValueError(f"{name} must be a token id in [0, vocab_size={vocab}), got {value}.")
    return int(value)


def _check_max_new(max_new):
    if isinstance(max_new, bool) or not isinstance(max_new, (int, np.integer)):
        raise TypeError(f"max_new must be an int, got {max_new!r}.")
    if max_new < 0:
        raise ValueError(f"max_new must be >= 0, got {max_new}.")
    return int(max_new)


def _check_sampling(temperature, top_k, top_p, key, vocab):
    if is_concrete(temperature):
        t = float(temperature)
        if math.isnan(t) or t < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}.")
        if t > 0 and key is None:
            raise ValueError("temperature > 0 samples at random; pass key=jax.random.key(...).")
    if top_k is None:
        top_k = vocab if vocab is not None else np.iinfo(np.int32).max
    elif isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 1:
        raise ValueError(f"top_k must be an int >= 1 or None, got {top_k!r}.")
    if top_p is None:
        top_p = 1.0
    elif (
        isinstance(top_p, bool)
        or not isinstance(top_p, (int, float, np.integer, np.floating))
        or not 0 < top_p <= 1
    ):
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}.")
    return temperature, top_k, top_p


def _row_keys(key, batch: int, batched: bool):
    if key is None:
        return jnp.zeros((batch, 2), jnp.uint32)
    key = jnp.asarray(key)
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    if key.shape != (2,) or key.dtype != jnp.uint32:
        raise TypeError(
            "key must be one PRNG key (jax.random.key(seed) or jax.random.PRNGKey(seed)), "
            f"got shape {key.shape} and dtype {key.dtype}."
        )
    return jax.random.split(key, batch) if batched else key[None]
