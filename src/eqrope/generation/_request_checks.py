"""The checks of `generate`'s inputs that need the model: the prompt and its lengths, token
ids below the vocabulary, the key, and the draft. `_request.py` gathers their results.
"""

import functools

import jax
import numpy as np

from .._checks import as_int_array, check_int, check_key, check_vocab, is_int
from ._generation_config import GenerationConfig
from ._settings import token_id
from ._stop_strings import StopStrings
from .speculative._acceptance import RULES
from .speculative._prompt_lookup import PromptLookup


UNDER_JIT = (
    "generate got a traced {name}: it was called inside jax.jit, jax.vmap or "
    "eqx.filter_jit. generate is already one compiled program and reads its results on the "
    "host, so call it outside any transformation (jax.grad of its log-probabilities is "
    "supported). For settings that differ per row (max_new, temperature, top_k, top_p, "
    "min_p, the penalties, min_new), pass a (batch,) array of them with a (batch, seq) "
    "prompt instead of mapping generate: temperature=jnp.array([0.5, 1.0]). To write your "
    "own compiled loop, jit model.prefill and model.step."
)


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
    stop = []
    for i, sequence in enumerate(settings.stop or ()):
        if isinstance(sequence, StopStrings):
            if vocab is not None and sequence.vocab_size > vocab:
                raise ValueError(
                    f"stop[{i}] is a StopStrings over a tokenizer of {sequence.vocab_size} token "
                    f"ids, but the model's vocab_size is {vocab}; build it with the model's tokenizer."
                )
            continue
        if isinstance(sequence, str):
            raise TypeError(
                f"stop[{i}] is the string {sequence!r}; generate takes token-id sequences. "
                "Use eqrope.generate_text, which encodes strings, or tokenizer.encode(...)."
            )
        for j, v in enumerate(sequence):
            token_id(v, f"stop[{i}][{j}]", vocab)
        stop.append(sequence)
    return eos_ids, bad_ids, stop


def _padded(ids: list[int]) -> np.ndarray:
    """`ids` padded with -1 (no id) to a power of two, at least 8, so that no list and
    any list of up to 8 ids share one program, and longer ones one per size bucket."""
    out = np.full((max(8, 1 << max(len(ids) - 1, 0).bit_length()),), -1, np.int32)
    out[: len(ids)] = ids
    return out


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
    if not is_int(max_len) or max_len < 1:
        raise TypeError(
            "generate needs a model with an integer `max_len` attribute (and either the "
            f"cache protocol or `model(ids) -> logits`); got {type(model).__name__}."
        )
    return int(max_len)


def _check_prompt(prompt, prompt_lengths, max_len, vocab):
    _refuse_text_and_ragged_rows(prompt)
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


def _refuse_text_and_ragged_rows(prompt) -> None:
    """A `TypeError` for a prompt of text, which goes to `generate_text`; a `ValueError` for
    a list of rows of different lengths, which go in one right-padded array with their
    `prompt_lengths`. Each says what to pass instead."""
    rows = list(prompt) if isinstance(prompt, (list, tuple)) else None
    if isinstance(prompt, str) or (rows and all(isinstance(r, str) for r in rows)):
        example = repr(prompt if isinstance(prompt, str) else rows[0])
        raise TypeError(
            f"prompt must be token ids, got text ({example}): generate takes ids. For text in "
            f"and out use eqrope.generate_text(model, tokenizer, {example}, max_new) with an "
            "eqrope.Tokenizer, or pass tokenizer.encode(text)."
        )
    if not rows or not all(np.ndim(r) == 1 for r in rows):
        return
    lengths = [len(r) for r in rows]
    if len(set(lengths)) > 1:
        raise ValueError(
            f"prompt is a ragged list (rows of {lengths} tokens), not an array. Pad the rows "
            f"on the right to {max(lengths)} tokens (any id) into one (batch, seq) array and "
            f"pass their lengths: prompt_lengths={lengths} (Tokenizer.encode_batch returns "
            "both)."
        )


def _check_fixed_rows(rows: int | None, batched: bool, shape: tuple[int, int]) -> None:
    """Refuse a prompt whose rows differ from the model's `fixed_rows` `rows` (an `int`
    when the model runs on exactly that many rows, as with adapters chosen per row),
    before any trace: a 1-D prompt is one row, which such a model cannot run on."""
    if rows is None or (batched and shape[0] == rows):
        return
    got = f"a (batch, seq) prompt of {shape[0]} rows" if batched else f"a 1-D prompt (shape {shape[1:]})"
    raise ValueError(
        f"the model's adapters are chosen for {rows} rows (eqrope.select_adapters), so it "
        f"needs a ({rows}, seq) prompt, one row per adapter id; got {got}. Pass one adapter "
        "id per row of the batch, or eqrope.take_adapter(...) for one prompt."
    )


def _check_key(key):
    """One typed PRNG key, of any implementation (threefry, rbg, ...).

    Raw `uint32` key data (`jax.random.PRNGKey(0)`) is read with the default
    implementation. `None` gives the default implementation's key 0, used only by greedy
    decoding, which draws nothing.
    """
    if key is None:
        return _zero_key(jax.config.jax_default_prng_impl)
    return check_key(key)


@functools.cache
def _zero_key(impl: str):
    return jax.random.key(0, impl=impl)
