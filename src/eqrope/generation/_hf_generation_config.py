"""transformers' `generation_config.json`: which fields eqrope reads, which change nothing,
and which it refuses; `GenerationConfig.from_pretrained` reads the file through here.
"""

from .._checks import check_bool, check_int
from .._json import checked
from ._settings import _CHECKS, _bad, _eos, _stop


# Fields that do not change which tokens come out, or that eqrope sets another way
# (the cache, compilation, what `generate` returns).
_IGNORED = {
    "bos_token_id", "decoder_start_token_id", "transformers_version", "_from_model_config",
    "use_cache", "return_dict_in_generate", "output_scores", "output_logits",
    "output_attentions", "output_hidden_states", "output_past_key_values",
    "cache_implementation", "cache_config", "max_cache_len", "low_memory",
    "compile_config", "disable_compile", "prefill_chunk_size", "continuous_batching_config",
}  # fmt: skip
# Fields eqrope does not implement, with the values at which they change nothing:
# transformers' default first (`GenerationConfig._get_default_generation_params`), then
# null (transformers 5 writes null for "the default") and any other no-op spelling.
# Accepted only at one of them. The assistant fields act only with an assistant model
# (eqrope's is `generate(..., draft=...)`, with its own `draft_len`).
_UNSUPPORTED = {
    "num_beams": (1, None), "num_beam_groups": (1, None), "diversity_penalty": (0.0, None),
    "length_penalty": (1.0, None), "early_stopping": (False, None), "typical_p": (1.0, None),
    "epsilon_cutoff": (0.0, None), "eta_cutoff": (0.0, None), "top_h": (None,),
    "no_repeat_ngram_size": (0, None), "encoder_no_repeat_ngram_size": (0, None),
    "encoder_repetition_penalty": (1.0, None), "min_length": (0, None),
    "forced_bos_token_id": (None,), "forced_eos_token_id": (None,),
    "remove_invalid_values": (False, None), "suppress_tokens": (None, []),
    "begin_suppress_tokens": (None, []), "exponential_decay_length_penalty": (None,),
    "sequence_bias": (None, {}, []), "guidance_scale": (None, 1.0), "penalty_alpha": (None,),
    "renormalize_logits": (False, None), "watermarking_config": (None,),
    "max_time": (None,), "token_healing": (False, None), "use_mtp": (False, None),
    "dola_layers": (None,), "constraints": (None,), "force_words_ids": (None,),
    "is_assistant": (False, None), "num_assistant_tokens": (20, None),
    "num_assistant_tokens_schedule": ("constant", None),
    "assistant_confidence_threshold": (0.4, None), "assistant_lookbehind": (10, None),
    "target_lookbehind": (10, None), "assistant_early_exit": (None,),
    "assistant_ensemble_weight": (None,), "prompt_lookup_num_tokens": (None,),
    "max_matching_ngram_size": (None,), "speculation_type": (None,),
}  # fmt: skip
# What to do instead, for the unsupported fields that have an eqrope counterpart.
_INSTEAD = {
    "num_assistant_tokens": "pass draft_len=... to generate with a draft=...",
    "prompt_lookup_num_tokens": "pass draft='prompt_lookup' and draft_len=... to generate",
    "max_matching_ngram_size": "pass draft=eqrope.PromptLookup(max_ngram=...) to generate",
    "suppress_tokens": "use bad_ids",
}
# The fields read, each with the `GenerationConfig` field it becomes.
_READ = {
    "max_new_tokens": "max_new", "max_length": "max_total", "do_sample": None,
    "temperature": "temperature",
    "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty", "eos_token_id": "eos_id",
    "pad_token_id": "pad_id", "stop_strings": "stop", "min_new_tokens": "min_new",
    "bad_words_ids": "bad_ids", "num_return_sequences": "num_samples",
}  # fmt: skip


# transformers' default length: without max_new_tokens and max_length, `generate` adds 20
# tokens to the prompt (`_get_default_generation_params`' max_length, counted as new).
_DEFAULT_NEW_TOKENS = 20


# transformers' keywords of `generate` that eqrope spells differently, with what to do
# instead: the fields of generation_config.json that eqrope reads (`_READ`) under their
# eqrope names, a few keywords no file holds, and the unimplemented fields (`_UNSUPPORTED`).
_KEYWORDS = {
    **{k: f"eqrope's is {v}" for k, v in _READ.items() if v is not None and v != k},
    "do_sample": "eqrope samples when temperature > 0 (pass key=jax.random.key(...)); "
    "temperature=0, the default, is greedy",
    "max_length": "pass max_new (the new tokens), or max_total (the prompt and the new tokens, "
    "as max_length); max_len is the cache rows, which bound the text",
    "input_ids": "pass the prompt as generate's second argument",
    "attention_mask": "pass prompt_lengths (the rows right-padded)",
    "generation_config": "pass config=eqrope.GenerationConfig(...)",
    "streamer": "pass on_token=function(row, position, token), or use generate_text(..., stream=True)",
    "assistant_model": "pass draft=small_model",
    "output_scores": "pass return_logprobs=True",
    "output_logits": "pass return_logprobs=True (its .model_logprobs)",
    "return_dict_in_generate": "pass return_logprobs=True",
    **{k: "eqrope does not implement it" for k in _UNSUPPORTED},
    **_INSTEAD,
}  # fmt: skip


# Keywords of other sampling APIs (vLLM's `SamplingParams`, OpenAI's) that eqrope spells
# differently: what to pass instead, `{value}` the int passed (else the keyword's name).
_OTHER_KEYWORDS = {
    "seed": "eqrope samples with a PRNG key, not a seed: pass key=jax.random.key({value}) to "
    "the call that samples (a new key gives new samples)",
}


def refuse_hf_keywords(given, who: str, *, unknown: bool = False) -> None:
    """Raise a `TypeError` for a keyword of transformers' `generate` among the names
    `given` (a dict of keywords, or their names), saying what eqrope takes instead, and
    for one of other APIs (`seed`); with `unknown=True`, for any name (those of a
    function's `**unknown`), as Python would."""
    for name in given:
        if name in _OTHER_KEYWORDS:
            value = given[name] if isinstance(given, dict) else None
            shown = value if isinstance(value, int) and not isinstance(value, bool) else name
            raise TypeError(
                f"{who}() got {name}={'' if value is None else repr(value)}: "
                f"{_OTHER_KEYWORDS[name].format(value=shown)}."
            )
        if name in _KEYWORDS:
            raise TypeError(
                f"{who}() got {name}=, a keyword of transformers' generate: {_KEYWORDS[name]}. "
                "docs/generation.md (\"eqrope's keywords against transformers'\") maps each."
            )
        if unknown:
            raise TypeError(
                f"{who}() got an unexpected keyword argument {name!r} (docs/generation.md maps "
                "transformers' keywords to eqrope's)."
            )


def _same(value, neutral) -> bool:
    """`value == neutral`, where a bool equals only a bool (`1` is not `True`) and a
    number any equal number (`1` is `1.0`)."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return type(value) is type(neutral) and value == neutral
    numbers = isinstance(value, (int, float)) and isinstance(neutral, (int, float))
    return (type(value) is type(neutral) or numbers) and value == neutral


def eos_ids_of(value, name: str) -> list[int]:
    """The token ids of a file's `eos_token_id` field, checked as `name`: null or `[]` is
    none, an int one id, a list several."""
    if value is None or (isinstance(value, list) and not value):
        return []
    ids = _eos(value, name)
    return [ids] if isinstance(ids, int) else list(ids)


def hf_generation_fields(hf: dict, where: str = "GenerationConfig.from_pretrained") -> dict:
    """The `GenerationConfig` fields of a transformers `generation_config.json` object.

    Each field is checked under its key in the file; an error is a `ValueError` that starts
    with `where` (who reads which file)."""
    refused = sorted(
        f"{k}={v!r}" + (f" ({_INSTEAD[k]})" if k in _INSTEAD else "")
        for k, v in hf.items()
        if k not in _READ and k not in _IGNORED
        and (k not in _UNSUPPORTED or not any(_same(v, n) for n in _UNSUPPORTED[k]))
    )  # fmt: skip
    if refused:
        raise ValueError(
            f"{where}: eqrope does not implement {', '.join(refused)} (docs/generation.md "
            "lists what it reads; each is accepted at transformers' default). Build a "
            "GenerationConfig by hand without them."
        )

    def field(key, check=None, **kwargs):
        """The file's `key` (`None` when absent), checked under that name."""
        value = hf.get(key)
        if value is None:
            return None
        return checked(check or _CHECKS[_READ[key]], value, key, where, **kwargs)

    sample = bool(field("do_sample", check_bool))
    temperature = field("temperature")
    # Absent or null, transformers' default 50 (which acts only when sampling); 0 is off.
    top_k = field("top_k", check_int, minimum=0) if hf.get("top_k") is not None else 50
    top_p = field("top_p")
    bad = hf.get("bad_words_ids")
    if bad is not None:
        if not isinstance(bad, list) or any(not isinstance(w, list) or len(w) != 1 for w in bad):
            raise ValueError(
                f"{where}: bad_words_ids={bad!r}; eqrope bans single tokens only (bad_ids), "
                "not multi-token words, so each entry must be a list of one token id, like "
                "[[3], [4]]."
            )
        bad = checked(_bad, [w[0] for w in bad], "bad_words_ids", where) if bad else None
    stop = hf.get("stop_strings")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(t, str) for t in stop):
            raise ValueError(
                f"{where}: stop_strings={hf['stop_strings']!r}; it must be a string or a list "
                "of strings."
            )
        stop = checked(_stop, stop, "stop_strings", where) if stop else None
    n = field("num_return_sequences")
    eos = checked(eos_ids_of, hf.get("eos_token_id"), "eos_token_id", where)
    # transformers' lengths: max_new_tokens wins; else max_length is the prompt and the new
    # tokens together; else 20 new tokens (`_prepare_generated_length`).
    max_new, max_total = field("max_new_tokens"), field("max_length")
    if max_new is None and max_total is None:
        max_new = _DEFAULT_NEW_TOKENS
    return dict(
        max_new=max_new,
        max_total=max_total if max_new is None else None,
        temperature=(1.0 if temperature is None else temperature) if sample else 0.0,
        top_k=top_k or None,  # 0 is off
        top_p=None if top_p == 1.0 else top_p,
        min_p=field("min_p"),
        repetition_penalty=field("repetition_penalty") or 1.0,
        eos_id=eos[0] if isinstance(hf.get("eos_token_id"), int) else tuple(eos) or None,
        pad_id=field("pad_token_id"),
        stop=stop,
        min_new=field("min_new_tokens") or 0,
        bad_ids=bad,
        num_samples=None if n == 1 else n,
    )
