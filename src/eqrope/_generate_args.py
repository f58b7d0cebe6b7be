"""The arguments of `eqrope.generate`, checked once and gathered into a `Request`.

Everything here runs on the host before anything compiles, so a bad argument raises a
clear `TypeError`/`ValueError` naming it, and the compiled program sees only arrays.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from ._checks import as_int_array, check_int, check_vocab, is_concrete
from ._sampling import Sampling


@dataclasses.dataclass(frozen=True)
class Request:
    """One checked `generate` call.

    - `batched`: the prompt was `(batch, seq)` (else `(seq,)`, held here as one row).
    - `prompt`: `(batch, seq)` int32 token ids; `lengths`: `(batch,)` real lengths.
    - `max_len`: the model's; `max_new`: the most new tokens per row.
    - `sampling`: the traced settings; `keys`: `(batch, 2)` uint32 row keys.
    - `pad_id`: fills positions after a row's end.
    """

    batched: bool
    prompt: np.ndarray
    lengths: np.ndarray
    max_len: int
    max_new: int
    sampling: Sampling
    keys: jax.Array
    pad_id: int

    @property
    def total(self) -> int:
        """The width of the returned tokens: `min(seq + max_new, max_len)`."""
        return min(self.prompt.shape[1] + self.max_new, self.max_len)


def parse_request(
    model, prompt, max_new, *, temperature, top_k, top_p, key, eos_id, prompt_lengths, pad_id
) -> Request:
    """Check every argument of `generate` that is about the text and the sampling."""
    max_len = _max_len(model)
    vocab = getattr(model, "vocab_size", None)
    batched, prompt, lengths = _check_prompt(prompt, prompt_lengths, max_len, vocab)
    max_new = check_int(max_new, "max_new", minimum=0)
    temperature, top_k, top_p = _check_sampling(temperature, top_k, top_p, key, vocab)
    eos_id = _check_token_id(eos_id, "eos_id", vocab)
    pad_id = _check_token_id(pad_id, "pad_id", vocab)
    if pad_id is None:
        pad_id = 0 if eos_id is None else eos_id
    sampling = Sampling(
        temperature=jnp.asarray(temperature, jnp.float32),
        top_k=jnp.asarray(top_k, jnp.int32),
        top_p=jnp.asarray(top_p, jnp.float32),
        eos=jnp.asarray(-1 if eos_id is None else eos_id, jnp.int32),
    )
    keys = _row_keys(key, prompt.shape[0], batched)
    return Request(batched, prompt, lengths, max_len, max_new, sampling, keys, pad_id)


def has_cache_protocol(model) -> bool:
    """True for models with `init_cache`, `prefill` and `step` (like `RotaryDecoder`).

    `generate` calls `prefill(ids, cache, pos, check=False)` and `step(token, cache, pos,
    check=False, kv_bound=bound)` after checking the prompt itself.
    """
    return all(callable(getattr(model, name, None)) for name in ("init_cache", "prefill", "step"))


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
    prompt = np.asarray(prompt)
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
        lengths = np.asarray(as_int_array(prompt_lengths, "prompt_lengths", ndim=1))
        if lengths.shape[0] != batch:
            raise ValueError(
                f"prompt_lengths has {lengths.shape[0]} entries but prompt has {batch} rows."
            )
        if ((lengths < 1) | (lengths > seq)).any():
            raise ValueError(
                f"prompt_lengths must be in [1, {seq}] (the prompt's width), got "
                f"{lengths.tolist()}."
            )
    if vocab is not None:
        real = np.arange(seq)[None, :] < lengths[:, None]
        check_vocab(prompt, vocab, "prompt", valid=real)
    return batched, prompt, lengths


def _check_token_id(value, name: str, vocab):
    value = check_int(value, name, none=True)
    if value is not None and (value < 0 or (vocab is not None and value >= vocab)):
        raise ValueError(f"{name} must be a token id in [0, vocab_size={vocab}), got {value}.")
    return value


def _check_sampling(temperature, top_k, top_p, key, vocab):
    if is_concrete(temperature):
        t = float(temperature)
        if math.isnan(t) or t < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}.")
        if t > 0 and key is None:
            raise ValueError("temperature > 0 samples at random; pass key=jax.random.key(...).")
    top_k = check_int(top_k, "top_k", minimum=1, none=True)
    if top_k is None:
        top_k = vocab if vocab is not None else np.iinfo(np.int32).max
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
