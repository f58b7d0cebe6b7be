"""The arguments of `eqrope.generate`, checked once and gathered into a `Request`.

Everything here runs on the host before anything compiles, so a bad argument raises a
clear `TypeError`/`ValueError` naming it, and the compiled program sees only arrays.
"""

import dataclasses
import functools
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
    - `max_len`: the positions this call can hold: the cache rows of the cached path
      (see `cache_rows`); `max_new`: the most new tokens per row.
    - `sampling`: the traced settings; `key`: one typed PRNG key (rows derive theirs).
    - `pad_id`: fills positions after a row's end.
    """

    batched: bool
    prompt: np.ndarray
    lengths: np.ndarray
    max_len: int
    max_new: int
    sampling: Sampling
    key: jax.Array
    pad_id: int

    @property
    def total(self) -> int:
        """The width of the returned tokens: `min(seq + max_new, max_len)`."""
        return min(self.prompt.shape[1] + self.max_new, self.max_len)


def cache_rows(seq: int, max_new: int, model_max_len: int, max_len: int | None) -> int:
    """The cache length of one `generate` call.

    `max_len=None` picks the smallest power of two (at least 16) that holds the prompt
    and `max_new` tokens, capped at the model's `max_len`: a 20-token job on a model built
    for 131072 positions gets 32 rows, and the program compiles once per power of two.
    An explicit `max_len` (at most the model's) pins one length, hence one program, for
    every call.
    """
    if max_len is None:
        wanted = max(16, seq + max_new)
        return min(1 << (wanted - 1).bit_length(), model_max_len)
    max_len = check_int(max_len, "max_len", minimum=1)
    if max_len > model_max_len:
        raise ValueError(
            f"max_len={max_len}, but the model's max_len is {model_max_len}; the cache "
            f"cannot hold more positions than the model. Pass at most {model_max_len}."
        )
    if max_len < seq:
        raise ValueError(
            f"max_len={max_len} cache rows cannot hold the prompt's {seq} tokens; pass "
            f"max_len >= {seq}, or None to size the cache from the prompt and max_new."
        )
    return max_len


def parse_request(
    model, prompt, max_new, *, max_len, temperature, top_k, top_p, key, eos_id, prompt_lengths, pad_id
) -> Request:
    """Check every argument of `generate` that is about the text and the sampling."""
    for name, value in (("prompt", prompt), ("prompt_lengths", prompt_lengths)):
        if not is_concrete(value):
            raise TypeError(UNDER_JIT.format(name=name))
    model_max_len = _max_len(model)
    vocab = getattr(model, "vocab_size", None)
    batched, prompt, lengths = _check_prompt(prompt, prompt_lengths, model_max_len, vocab)
    max_new = check_int(max_new, "max_new", minimum=0)
    rows = cache_rows(prompt.shape[1], max_new, model_max_len, max_len)
    max_new = min(max_new, rows)  # the cache stops the text first; keeps it an int32
    temperature, top_k, top_p = _check_sampling(temperature, top_k, top_p, key, vocab)
    eos_ids = _check_eos(eos_id, vocab)
    pad_id = _check_token_id(pad_id, "pad_id", vocab)
    if pad_id is None:
        pad_id = eos_ids[0] if eos_ids else 0
    # NumPy scalars: `jnp.asarray` would dispatch a device op for each.
    sampling = Sampling(
        temperature=np.asarray(temperature, np.float32),
        top_k=np.asarray(top_k, np.int32),
        top_p=np.asarray(top_p, np.float32),
        eos=np.asarray(eos_ids or [-1], np.int32),
    )
    return Request(batched, prompt, lengths, rows, max_new, sampling, _check_key(key), pad_id)


UNDER_JIT = (
    "generate got a traced {name}: it was called inside jax.jit, jax.vmap or "
    "eqx.filter_jit. generate is already one compiled program and reads its results on the "
    "host, so call it outside any transformation (jax.grad of its log-probabilities is "
    "supported). To write your own compiled loop, jit model.prefill and model.step."
)


def has_cache_protocol(model) -> bool:
    """True for models with `init_cache`, `prefill` and `step` (like `RotaryDecoder`).

    `generate` calls `prefill(ids, cache, pos, check=False)` and `step(token, cache, pos,
    check=False, kv_bound=bound, kv_low=low)` after checking the prompt itself.
    """
    # On the type: an `eqx.Module` instance's getattr builds a bound method each time.
    kind = type(model)
    return all(callable(getattr(kind, name, None)) for name in ("init_cache", "prefill", "step"))


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
        shape = prompt.shape if batched else prompt.shape[1:]
        raise ValueError(f"prompt is empty (shape {shape}); pass at least one token.")
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


def _check_eos(eos_id, vocab) -> list[int]:
    """`eos_id` as a list of token ids: an int, or a sequence of ints (Llama-3 instruct
    checkpoints end on any of three), or `None` for none."""
    if eos_id is None:
        return []
    if isinstance(eos_id, (list, tuple, np.ndarray)):
        ids = [_check_token_id(v, f"eos_id[{i}]", vocab) for i, v in enumerate(np.asarray(eos_id, dtype=object).tolist())]
        if not ids:
            raise ValueError("eos_id is an empty sequence; pass None for no end token.")
        return ids
    return [_check_token_id(eos_id, "eos_id", vocab)]


def _check_token_id(value, name: str, vocab):
    value = check_int(value, name, none=True)
    if value is not None and (value < 0 or (vocab is not None and value >= vocab)):
        raise ValueError(f"{name} must be a token id in [0, vocab_size={vocab}), got {value}.")
    return value


def _check_sampling(temperature, top_k, top_p, key, vocab):
    if is_concrete(temperature):
        t = _real(temperature, "temperature", "a number >= 0 (0 is greedy)")
        if math.isnan(t) or t < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}.")
        if t > 0 and key is None:
            raise ValueError("temperature > 0 samples at random; pass key=jax.random.key(...).")
    top_k = check_int(top_k, "top_k", minimum=1, none=True)
    limit = vocab if vocab is not None else np.iinfo(np.int32).max
    # A top_k of at least the vocabulary keeps everything, whatever its size.
    top_k = limit if top_k is None else min(top_k, limit)
    if top_p is None:
        top_p = 1.0
    else:
        top_p = _real(top_p, "top_p", "a number in (0, 1] or None")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}.")
    return temperature, top_k, top_p


def _real(value, name: str, wanted: str) -> float:
    """A Python, NumPy or 0-d JAX real scalar as a float; anything else is refused by name."""
    if hasattr(value, "dtype") and getattr(value, "ndim", None) == 0 and not isinstance(value, np.generic):
        value = np.asarray(value)[()]  # a 0-d JAX or NumPy array: its NumPy scalar
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be {wanted}, got {value!r} ({type(value).__name__}).")
    return float(value)


def _check_key(key):
    """One typed PRNG key, of any implementation (threefry, rbg, ...).

    Raw `uint32` key data (`jax.random.PRNGKey(0)`) is read with the default
    implementation. `None` gives the default implementation's key 0, used only by greedy
    decoding, which draws nothing.
    """
    if key is None:
        return _zero_key(jax.config.jax_default_prng_impl)
    if not hasattr(key, "dtype") or not hasattr(key, "shape"):
        raise TypeError(f"key must be a PRNG key (jax.random.key(seed)), got {type(key).__name__}.")
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.shape != ():
            raise TypeError(f"key must be one PRNG key, got a key array of shape {key.shape}.")
        return key
    try:
        return jax.random.wrap_key_data(key)
    except (TypeError, ValueError):
        raise TypeError(
            "key must be one PRNG key (jax.random.key(seed) or jax.random.PRNGKey(seed)), "
            f"got shape {key.shape} and dtype {key.dtype}."
        ) from None


@functools.cache
def _zero_key(impl: str):
    return jax.random.key(0, impl=impl)
