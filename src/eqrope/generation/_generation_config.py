"""`eqrope.GenerationConfig`: the settings of a `generate` call, in one frozen record.

Its checks are the only checks of these settings: `generate`'s keywords become a
`GenerationConfig` (over the one passed as `config=`), so a bad value raises the same
message whichever way it came. The checks that need the vocabulary (token ids below
`vocab_size`) run in `_request.py`, once the model is known.
"""

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from jaxtyping import ArrayLike

from .._checks import check_bool, check_int
from .._json import checked, read_json


class _FromConfig:
    """The default of `generate`'s settings: "not passed, take the config's value"."""

    def __repr__(self) -> str:
        return "FROM_CONFIG"


FROM_CONFIG = _FromConfig()


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """The settings of [`eqrope.generate`][], as a small frozen record.

    Every field is a keyword of `generate` of the same name, and means the same:
    `generate(model, prompt, config=cfg, top_p=0.9)` runs with `cfg`'s settings and
    `top_p=0.9`. The defaults are greedy decoding without any processor, which
    reproduces `generate`'s tokens without a config.

    - `max_new`: the most new tokens per row (`None`: `generate` must be given it).
    - `temperature`: 0 is greedy; above 0 samples.
    - `top_k`, `top_p`, `min_p`: truncation of the sampled distribution, applied in this
      order after the temperature (transformers' order); `None` turns each off. `min_p`
      (Nguyen et al. 2024) drops the tokens whose probability is below `min_p` times the
      top token's.
    - `repetition_penalty`: transformers' (Keskar et al. 2019): the logit of every token
      already in the prompt or the generated text is divided by it when positive and
      multiplied by it when negative. 1 is none; it must be > 0.
    - `presence_penalty`, `frequency_penalty`: OpenAI's, over the generated tokens only:
      `logit - frequency_penalty * count - presence_penalty * (count > 0)`. 0 is none;
      negative values encourage repetition.
    - `eos_id`: a token id or a sequence of ids that end a row (the EOS is kept).
    - `pad_id`: fills positions after a row's end; `None`: the first `eos_id`, else 0.
    - `stop`: token-id sequences, such as `[[13, 13], [50256]]`: a row ends after the
      first complete match (kept in the text). Strings are for
      [`eqrope.generate_text`][], which encodes them.
    - `min_new`: neither an EOS nor a stop sequence ends a row before it has this many
      new tokens (EOS ids are masked out of the first `min_new` tokens, as transformers'
      `min_new_tokens`).
    - `bad_ids`: token ids that are never produced.
    - `num_samples`: `n` continuations per prompt that share one prefill; `None` is one,
      without the extra axis.

    The fields are stored checked and plain: numbers as `float`, id lists as tuples.
    Use `dataclasses.replace(cfg, top_k=None)` for a changed copy.
    """

    max_new: int | None = None
    temperature: float | ArrayLike = 0.0
    top_k: int | None = None
    top_p: float | ArrayLike | None = None
    min_p: float | ArrayLike | None = None
    repetition_penalty: float | ArrayLike = 1.0
    presence_penalty: float | ArrayLike = 0.0
    frequency_penalty: float | ArrayLike = 0.0
    eos_id: int | Sequence[int] | ArrayLike | None = None
    pad_id: int | None = None
    stop: Sequence | None = None
    min_new: int = 0
    bad_ids: Sequence[int] | ArrayLike | None = None
    num_samples: int | None = None

    def __post_init__(self):
        for name, check in _CHECKS.items():
            object.__setattr__(self, name, check(getattr(self, name), name))

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "GenerationConfig":
        """Read transformers' `generation_config.json` (a file, or the folder holding it).

        `do_sample: false` (transformers' default) reads as greedy, `temperature: 0`;
        a `top_k` the file does not set (or sets to null) is transformers' default 50 (it
        only acts when sampling); `top_k: 0` and `top_p: 1` read as `None`; null, as in
        transformers 5, is the default of any field, and `[]` is none for the id and string
        lists. The fields are mapped as in docs/generation.md.

        Raises `FileNotFoundError` without the file, and `ValueError`, naming the file and
        the key, for a field of the wrong type or range (`"eos_token_id": "</s>"`,
        `"do_sample": "yes"`, `"top_p": 1.5`), an unknown field, or a field eqrope does not
        implement (beam search, `suppress_tokens: [5]`, the assistant fields) at a value
        other than one that changes nothing (transformers' default, null, `[]`):
        `num_assistant_tokens` other than 20 says to pass `draft_len` to `generate`.
        """
        file = Path(path)
        if file.is_dir():
            file = file / "generation_config.json"
        if not file.is_file():
            raise FileNotFoundError(f"GenerationConfig.from_pretrained: no file {file}.")
        who = "GenerationConfig.from_pretrained"
        return cls(**hf_generation_fields(read_json(file, who), f"{who}: {file}"))


def resolve(config: GenerationConfig | None, given: dict) -> GenerationConfig:
    """`config` (default `GenerationConfig()`) with the keywords in `given` that are not
    `FROM_CONFIG`, checked."""
    if config is None:
        config = _DEFAULT
    elif not isinstance(config, GenerationConfig):
        raise TypeError(f"config must be an eqrope.GenerationConfig, got {type(config).__name__}.")
    changes = {name: value for name, value in given.items() if value is not FROM_CONFIG}
    return dataclasses.replace(config, **changes) if changes else config


# -- the checks, one per field ---------------------------------------------------------------


def real(value, name: str, wanted: str) -> float:
    """A Python, NumPy or 0-d JAX real scalar as a float; anything else is refused by name."""
    if hasattr(value, "dtype") and getattr(value, "ndim", None) == 0 and not isinstance(value, np.generic):
        value = np.asarray(value)[()]  # a 0-d JAX or NumPy array: its NumPy scalar
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be {wanted}, got {value!r} ({type(value).__name__}).")
    return float(value)


def _temperature(value, name):
    t = real(value, name, "a number >= 0 (0 is greedy)")
    if math.isnan(t) or t < 0:
        raise ValueError(f"{name} must be >= 0 (0 is greedy), got {value}.")
    return t


def _fraction(low_open: bool, meaning: str):
    interval = "(0, 1]" if low_open else "[0, 1]"

    def check(value, name):
        if value is None:
            return None
        p = real(value, name, f"a number in {interval} or None")
        if not (0 < p <= 1 if low_open else 0 <= p <= 1):
            raise ValueError(f"{name} must be in {interval} or None ({meaning}), got {value!r}.")
        return p

    return check


def _repetition(value, name):
    p = real(value, name, "a number > 0 (1 is no penalty)")
    if not (math.isfinite(p) and p > 0):
        raise ValueError(
            f"{name} must be a finite number > 0 (1 is no penalty; above 1 discourages "
            f"repeating a token, below 1 encourages it), got {value!r}."
        )
    return p


def _additive(value, name):
    p = real(value, name, "a finite number (0 is no penalty)")
    if not math.isfinite(p):
        raise ValueError(f"{name} must be a finite number (0 is no penalty), got {value!r}.")
    return p


def token_id(value, name: str, vocab: int | None = None) -> int | None:
    """A token id in `[0, vocab)` (`[0, inf)` without a vocabulary), or `None`."""
    value = check_int(value, name, none=True)
    if value is not None and (value < 0 or (vocab is not None and value >= vocab)):
        where = ">= 0" if vocab is None else f"in [0, vocab_size={vocab})"
        raise ValueError(f"{name} must be a token id {where}, got {value}.")
    return value


def _is_sequence(value) -> bool:
    return isinstance(value, (list, tuple, np.ndarray)) or (
        hasattr(value, "ndim") and hasattr(value, "tolist") and value.ndim == 1
    )


def _ids(value, name: str, empty: str) -> tuple[int, ...]:
    ids = tuple(token_id(v, f"{name}[{i}]") for i, v in enumerate(np.asarray(value, dtype=object).tolist()))
    if not ids:
        raise ValueError(f"{name} is an empty sequence; {empty}")
    return ids


def _eos(value, name):
    """An int, or a sequence of ints (Llama-3 instruct checkpoints end on any of three)."""
    if value is None:
        return None
    if _is_sequence(value):
        return _ids(value, name, "pass None for no end token.")
    return token_id(value, name)


def _bad(value, name):
    if value is None:
        return None
    if not _is_sequence(value):
        raise TypeError(f"{name} must be a sequence of token ids or None, got {value!r}.")
    return _ids(value, name, "pass None to ban nothing.")


def _stop(value, name):
    if value is None:
        return None
    if isinstance(value, str) or not _is_sequence(value):
        raise TypeError(
            f"{name} must be a list of token-id sequences, like [[13, 13], [50256]] (or of "
            f"strings, for generate_text), got {value!r}."
        )
    entries = list(value)
    if not entries:
        raise ValueError(f"{name} is an empty list; pass None for no stop sequences.")
    if all(isinstance(e, (int, np.integer)) and not isinstance(e, bool) for e in entries):
        raise TypeError(
            f"{name} must be a list of token-id sequences; got a flat list {entries!r}. "
            f"Wrap one sequence in a list: {name}=[{entries!r}]."
        )
    out = []
    for i, entry in enumerate(entries):
        if isinstance(entry, str):
            if not entry:
                raise ValueError(f"{name}[{i}] is an empty string; every stop needs some text.")
            out.append(entry)
        elif _is_sequence(entry):
            out.append(_ids(entry, f"{name}[{i}]", "every stop sequence needs at least one token."))
        else:
            raise TypeError(f"{name}[{i}] must be a sequence of token ids or a string, got {entry!r}.")
    return tuple(out)


def _int(minimum: int, none: bool):
    def check(value, name):
        return check_int(value, name, minimum=minimum, none=none)

    return check


_CHECKS = {
    "max_new": _int(0, none=True),
    "temperature": _temperature,
    "top_k": _int(1, none=True),
    "top_p": _fraction(True, "the nucleus mass; None or 1 keeps everything"),
    "min_p": _fraction(False, "a fraction of the top token's probability; None or 0 keeps everything"),
    "repetition_penalty": _repetition,
    "presence_penalty": _additive,
    "frequency_penalty": _additive,
    "eos_id": _eos,
    "pad_id": token_id,
    "stop": _stop,
    "min_new": _int(0, none=False),
    "bad_ids": _bad,
    "num_samples": _int(1, none=True),
}
_DEFAULT = GenerationConfig()


# -- transformers' generation_config.json ------------------------------------------------------

# Fields that do not change which tokens come out, or that eqrope sets another way
# (the cache, compilation, what `generate` returns).
_IGNORED = {
    "bos_token_id", "decoder_start_token_id", "transformers_version", "_from_model_config",
    "use_cache", "return_dict_in_generate", "output_scores", "output_logits",
    "output_attentions", "output_hidden_states", "output_past_key_values",
    "cache_implementation", "cache_config", "max_cache_len", "max_length", "low_memory",
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
    "max_new_tokens": "max_new", "do_sample": None, "temperature": "temperature",
    "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty", "eos_token_id": "eos_id",
    "pad_token_id": "pad_id", "stop_strings": "stop", "min_new_tokens": "min_new",
    "bad_words_ids": "bad_ids", "num_return_sequences": "num_samples",
}  # fmt: skip


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
    return dict(
        max_new=field("max_new_tokens"),
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
