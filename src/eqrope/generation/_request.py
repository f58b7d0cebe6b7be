"""The arguments of `eqrope.generate`, checked once and gathered into a `Request`.

Everything here runs on the host before anything compiles, so a bad argument raises a
clear `TypeError`/`ValueError` naming it, and the compiled program sees only arrays.
"""

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from .._checks import as_int_array, check_int, check_vocab, is_concrete
from ._generation_config import GenerationConfig, token_id
from ._sampling import Sampling
from ._stopping import stop_table
from .speculative._acceptance import RULES
from .speculative._prompt_lookup import PromptLookup


@dataclasses.dataclass(frozen=True)
class Request:
    """One checked `generate` call.

    - `batched`: the prompt was `(batch, seq)` (else `(seq,)`, held here as one row).
    - `prompt`: `(batch, seq)` int32 token ids; `lengths`: `(batch,)` real lengths.
    - `max_len`: the positions this call can hold: the cache rows of the cached path
      (see `cache_rows`); `max_new`: the most new tokens per row.
    - `sampling`: the traced settings; `key`: one typed PRNG key (rows derive theirs).
    - `pad_id`: fills positions after a row's end.
    - `samples`: `num_samples` (`None`: one sample per prompt, without its axis).
    - `stream`: the `on_token` callback, or `None`.
    - `program`: which program runs the call: `"cached"` (a model with the cache
      protocol), `"speculative"` (with a `draft`) or `"uncached"` (any causal callable).
    - `chunk`: the prefill chunk; `check_finite`: stop and raise on non-finite logits.
    - `draft`, `draft_len`, `accept`: the speculative settings (`None` without a draft).
    - `mesh`, `rules`: the device mesh and its sharding rules, or `None`.
    - `differentiable`: the model's arrays are being differentiated (`jax.grad`), so the
      loop must be a scan.
    """

    batched: bool
    prompt: np.ndarray
    lengths: np.ndarray
    max_len: int
    max_new: int
    sampling: Sampling
    key: jax.Array
    pad_id: int
    samples: int | None = None
    stream: Callable[[int, int, int], object] | None = None
    program: str = "uncached"
    chunk: int = 64
    check_finite: bool = True
    draft: object = None
    draft_len: int | None = None
    accept: str | None = None
    mesh: object = None
    rules: object = None
    differentiable: bool = False

    def buffer(self) -> np.ndarray:
        """The prompts in `(batch, max_len)` rows, one column per cache row."""
        batch, seq = self.prompt.shape
        buffer = np.zeros((batch, self.max_len), np.int32)
        buffer[:, :seq] = self.prompt
        return buffer

    @property
    def rows(self) -> int:
        """The rows the program decodes: prompts times samples."""
        return self.prompt.shape[0] * (self.samples or 1)

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
    model,
    prompt,
    settings: GenerationConfig,
    *,
    max_len=None,
    key=None,
    prompt_lengths=None,
    stream=None,
    draft=None,
    draft_len=None,
    accept=None,
    check_finite=True,
    prefill_chunk=64,
    mesh=None,
    rules=None,
) -> Request:
    """Check every argument of `generate` beside the model's arrays into a `Request`.

    `settings` is already checked (`GenerationConfig`); here come the checks that need
    the model: the prompt, the cache length, token ids below its `vocab_size`, the draft,
    and which program can run the call (`jax.grad`, a mesh and `on_token` each rule some
    out).
    """
    for name, value in (("prompt", prompt), ("prompt_lengths", prompt_lengths)):
        if not is_concrete(value):
            raise TypeError(UNDER_JIT.format(name=name))
    if stream is not None and not callable(stream):  # every path, the uncached one too
        raise TypeError(f"on_token must be a function (row, position, token), got {stream!r}.")
    model_max_len = _max_len(model)
    vocab = getattr(model, "vocab_size", None)
    batched, prompt, lengths = _check_prompt(prompt, prompt_lengths, model_max_len, vocab)
    if settings.max_new is None:
        raise ValueError(
            "generate needs max_new, the most new tokens per row: pass max_new=..., or a "
            "config with max_new set."
        )
    rows = cache_rows(prompt.shape[1], settings.max_new, model_max_len, max_len)
    max_new = min(settings.max_new, rows)  # the cache stops the text first; keeps it an int32
    if settings.temperature > 0 and key is None:
        raise ValueError("temperature > 0 samples at random; pass key=jax.random.key(...).")
    eos_ids, bad_ids, stop = _check_ids(settings, vocab)
    pad_id = settings.pad_id
    if pad_id is None:
        pad_id = eos_ids[0] if eos_ids else 0
    limit = vocab if vocab is not None else np.iinfo(np.int32).max
    # A top_k of at least the vocabulary keeps everything, whatever its size.
    top_k = limit if settings.top_k is None else min(settings.top_k, limit)
    # NumPy scalars: `jnp.asarray` would dispatch a device op for each.
    sampling = Sampling(
        temperature=np.float32(settings.temperature),
        top_k=np.int32(top_k),
        top_p=np.float32(1.0 if settings.top_p is None else settings.top_p),
        eos=np.asarray(eos_ids or [-1], np.int32),
        min_p=np.float32(settings.min_p or 0.0),
        repetition_penalty=np.float32(settings.repetition_penalty),
        presence_penalty=np.float32(settings.presence_penalty),
        frequency_penalty=np.float32(settings.frequency_penalty),
        min_new=np.int32(min(settings.min_new, np.iinfo(np.int32).max)),
        bad=_padded(bad_ids),
        stop=stop_table(stop),
    )
    request = Request(
        batched, prompt, lengths, rows, max_new, sampling, _check_key(key), pad_id,
        settings.num_samples, stream,
    )  # fmt: skip
    return _check_program(
        request, model, draft, draft_len, accept, check_finite, prefill_chunk, mesh, rules
    )


def _check_program(request, model, draft, draft_len, accept, check_finite, chunk, mesh, rules):
    """`request` with the program that runs it and that program's settings, checked."""
    if rules is not None and mesh is None:
        raise ValueError("rules say how to place arrays on a mesh; pass mesh= too.")
    draft, draft_len, accept = _check_draft(model, draft, draft_len, accept, request.max_len)
    cached = has_cache_protocol(model)
    if not cached:
        if mesh is not None:
            raise ValueError("mesh is only for models with the cache protocol.")
        return dataclasses.replace(request, check_finite=bool(check_finite))
    chunk = min(check_int(chunk, "prefill_chunk", minimum=1), request.max_len)
    # Under `jax.grad` the model's arrays are tracers: the loop must be a scan.
    differentiable = not all(map(is_concrete, jax.tree.leaves((model, draft))))
    if draft is not None:
        if mesh is not None:
            raise ValueError("draft= does not run with mesh= yet; generate on a mesh without a draft.")
        if differentiable:
            raise ValueError(
                "draft= runs a while loop, which jax.grad cannot differentiate; take gradients "
                "of generate without a draft (the log-probabilities do not depend on it)."
            )
    elif request.stream is not None and (differentiable or mesh is not None):
        raise ValueError(
            "on_token streams from a plain generate call; it is not supported under "
            "jax.grad or with mesh=. Generate without on_token there."
        )
    return dataclasses.replace(
        request, program="cached" if draft is None else "speculative", chunk=chunk,
        check_finite=bool(check_finite), draft=draft, draft_len=draft_len, accept=accept,
        mesh=mesh, rules=rules, differentiable=differentiable,
    )  # fmt: skip


def _check_draft(model, draft, draft_len, accept, max_len: int):
    """The checked `(draft, draft_len, accept)` of a `generate` call whose cache has
    `max_len` rows: `draft` a model or a `PromptLookup` (`"prompt_lookup"` is the default
    one), or all three `None` when `draft` is `None`."""
    if draft is None:
        for name, value in (("draft_len", draft_len), ("accept", accept)):
            if value is not None:
                raise ValueError(
                    f"{name}={value!r} sets up speculative decoding, which needs a draft: "
                    "pass draft=a_small_model or draft='prompt_lookup' too."
                )
        return None, None, None
    if not has_cache_protocol(model):
        raise ValueError(
            "draft= speeds up the cached path; the model has no cache protocol (init_cache, "
            "prefill, step), so generate it without a draft."
        )
    if isinstance(draft, str):
        if draft != "prompt_lookup":
            raise ValueError(
                f"draft={draft!r}: the one named draft is 'prompt_lookup'; otherwise pass a "
                "model with the cache protocol, or eqrope.PromptLookup(...)."
            )
        draft = PromptLookup()
    elif not isinstance(draft, PromptLookup):
        _check_draft_model(model, draft, max_len)
    draft_len = check_int(4 if draft_len is None else draft_len, "draft_len", minimum=1)
    if draft_len + 1 > max_len:
        raise ValueError(
            f"draft_len={draft_len} verifies {draft_len + 1} positions at once, more than the "
            f"call's {max_len} cache rows; pass a smaller draft_len or a larger max_len."
        )
    accept = "residual" if accept is None else accept
    if accept not in RULES:
        raise ValueError(f"accept must be one of {RULES}, got {accept!r}.")
    return draft, draft_len, accept


def _check_draft_model(model, draft, max_len: int) -> None:
    if not has_cache_protocol(draft):
        raise TypeError(
            "draft must be a model with the cache protocol (init_cache, prefill, step), such "
            f"as a small eqrope.RotaryDecoder, or 'prompt_lookup'; got {type(draft).__name__}."
        )
    if draft.vocab_size != model.vocab_size:
        raise ValueError(
            f"the draft's vocab_size is {draft.vocab_size} but the model's is "
            f"{model.vocab_size}; a draft must share the model's vocabulary (its tokenizer)."
        )
    if draft.max_len < max_len:
        raise ValueError(
            f"the draft's max_len is {draft.max_len}, but this call's cache has {max_len} rows; "
            f"pass max_len <= {draft.max_len}, or use a draft built for more positions."
        )


def _check_ids(settings: GenerationConfig, vocab: int | None):
    """The EOS ids, banned ids and stop sequences, each id checked against `vocab`.

    Refused (`ValueError`): an id outside `[0, vocab)`; an id both banned and an EOS id;
    `bad_ids` banning every id; and `bad_ids` banning every id but the EOS ids while
    `min_new > 0` masks those, which would leave no token to choose from.
    """
    eos = settings.eos_id
    eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    name = "eos_id" if isinstance(eos, int) else "eos_id[{}]"
    for i, v in enumerate(eos_ids):
        token_id(v, name.format(i), vocab)
    token_id(settings.pad_id, "pad_id", vocab)
    bad_ids = list(settings.bad_ids or ())
    for i, v in enumerate(bad_ids):
        token_id(v, f"bad_ids[{i}]", vocab)
    both = sorted(set(bad_ids) & set(eos_ids))
    if both:
        raise ValueError(
            f"bad_ids and eos_id share {both}: a banned EOS could never end a row. Remove "
            "them from one of the two (transformers drops them from bad_words_ids)."
        )
    if vocab is not None and len(set(bad_ids)) >= vocab:
        raise ValueError(f"bad_ids bans all {vocab} token ids; leave at least one allowed.")
    if vocab is not None and settings.min_new > 0 and len(set(bad_ids) | set(eos_ids)) >= vocab:
        raise ValueError(
            f"bad_ids bans every token id but the eos_id ones {sorted(set(eos_ids))}, and "
            f"min_new={settings.min_new} masks those out of the first new tokens: no token is "
            "left to choose. Allow at least one more id, or pass min_new=0."
        )
    stop = settings.stop or ()
    for i, sequence in enumerate(stop):
        if isinstance(sequence, str):
            raise TypeError(
                f"stop[{i}] is the string {sequence!r}; generate takes token-id sequences. "
                "Use eqrope.generate_text, which encodes strings, or tokenizer.encode(...)."
            )
        for j, v in enumerate(sequence):
            token_id(v, f"stop[{i}][{j}]", vocab)
    return eos_ids, bad_ids, stop


def _padded(ids: list[int]) -> np.ndarray:
    """`ids` padded with -1 (no id) to a power of two, at least 8, so that no list and
    any list of up to 8 ids share one program, and longer ones one per size bucket."""
    out = np.full((max(8, 1 << max(len(ids) - 1, 0).bit_length()),), -1, np.int32)
    out[: len(ids)] = ids
    return out


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
