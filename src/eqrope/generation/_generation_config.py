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

from .._checks import check_int
from .._json import read_json


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
        a `top_k` the file does not set is transformers' default 50 (it only acts when
        sampling); `top_k: 0` and `top_p: 1` read as `None`. The fields are mapped as in
        docs/generation.md; a field eqrope does not implement (beam search, say) raises
        unless it holds transformers' default value.
        """
        file = Path(path)
        if file.is_dir():
            file = file / "generation_config.json"
        if not file.is_file():
            raise FileNotFoundError(f"GenerationConfig.from_pretrained: no file {file}.")
        return cls(**hf_generation_fields(read_json(file, "GenerationConfig.from_pretrained")))


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

# Fields that do not change which tokens come out, or that eqrope sets another way.
_IGNORED = {
    "bos_token_id", "decoder_start_token_id", "transformers_version", "_from_model_config",
    "use_cache", "return_dict_in_generate", "output_scores", "output_logits",
    "output_attentions", "output_hidden_states", "cache_implementation", "max_length",
}  # fmt: skip
# Fields eqrope does not implement, with transformers' default: accepted only at that value.
_UNSUPPORTED = {
    "num_beams": 1, "num_beam_groups": 1, "diversity_penalty": 0.0, "length_penalty": 1.0,
    "early_stopping": False, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0,
    "top_h": None, "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0,
    "encoder_repetition_penalty": 1.0, "min_length": 0, "forced_bos_token_id": None,
    "forced_eos_token_id": None, "remove_invalid_values": False, "suppress_tokens": None,
    "begin_suppress_tokens": None, "exponential_decay_length_penalty": None,
    "sequence_bias": None, "guidance_scale": None, "penalty_alpha": None,
    "renormalize_logits": False, "watermarking_config": None,
}  # fmt: skip
_READ = {
    "max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "min_p",
    "repetition_penalty", "eos_token_id", "pad_token_id", "stop_strings", "min_new_tokens",
    "bad_words_ids", "num_return_sequences",
}  # fmt: skip


def hf_generation_fields(hf: dict) -> dict:
    """The `GenerationConfig` fields of a transformers `generation_config.json` object."""
    refused = sorted(
        f"{k}={v!r}" for k, v in hf.items()
        if k not in _READ and k not in _IGNORED and (k not in _UNSUPPORTED or v != _UNSUPPORTED[k])
    )  # fmt: skip
    if refused:
        raise ValueError(
            f"GenerationConfig.from_pretrained: eqrope does not implement {', '.join(refused)} "
            "(docs/generation.md lists what it reads). Build a GenerationConfig by hand "
            "without them."
        )
    sample = bool(hf.get("do_sample") or False)
    top_k = hf.get("top_k", 50)  # transformers' default, when the file does not set one
    top_p = hf.get("top_p")
    bad = hf.get("bad_words_ids")
    if bad is not None:
        if not isinstance(bad, list) or any(not isinstance(w, list) or len(w) != 1 for w in bad):
            raise ValueError(
                "GenerationConfig.from_pretrained: bad_words_ids holds multi-token words "
                f"({bad!r}); eqrope bans single tokens only (bad_ids)."
            )
        bad = [w[0] for w in bad]
    stop = hf.get("stop_strings")
    n = hf.get("num_return_sequences")
    return dict(
        max_new=hf.get("max_new_tokens"),
        temperature=(1.0 if hf.get("temperature") is None else hf["temperature"]) if sample else 0.0,
        top_k=None if top_k in (None, 0) else top_k,
        top_p=None if top_p in (None, 1, 1.0) else top_p,
        min_p=hf.get("min_p"),
        repetition_penalty=1.0 if hf.get("repetition_penalty") is None else hf["repetition_penalty"],
        eos_id=hf.get("eos_token_id"),
        pad_id=hf.get("pad_token_id"),
        stop=[stop] if isinstance(stop, str) else stop,
        min_new=hf.get("min_new_tokens") or 0,
        bad_ids=bad,
        num_samples=None if n in (None, 1) else n,
    )

