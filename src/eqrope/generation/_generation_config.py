"""`eqrope.GenerationConfig`: the settings of a `generate` call, in one frozen record.

Its checks are the only checks of these settings: `generate`'s keywords become a
`GenerationConfig` (over the one passed as `config=`), so a bad value raises the same
message whichever way it came. The checks that need the vocabulary (token ids below
`vocab_size`) run in `_request.py`, once the model is known.
"""

import dataclasses
import functools
from collections.abc import Sequence
from pathlib import Path

from jaxtyping import ArrayLike

from .._checks import check_path
from .._custom_types import IntLike
from .._json import read_json
from ._hf_generation_config import hf_generation_fields
from ._settings import _CHECKS


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

    - `max_new`: the most new tokens per row (`None`: `generate` must be given it, or
      `max_total`).
    - `max_total`: transformers' `max_length`: the most tokens of a row, prompt and new
      tokens together, read when `max_new` is `None`: a call then adds up to
      `max_total - longest prompt` tokens, and refuses a prompt of `max_total` tokens or
      more. The two are exclusive: passing either to `generate` replaces the config's
      other, and `from_pretrained` reads a file's `max_length` only when it has no
      `max_new_tokens` (which wins, as in transformers).
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

    max_new: IntLike | None = None
    max_total: IntLike | None = None
    temperature: float | ArrayLike = 0.0
    top_k: IntLike | None = None
    top_p: float | ArrayLike | None = None
    min_p: float | ArrayLike | None = None
    repetition_penalty: float | ArrayLike = 1.0
    presence_penalty: float | ArrayLike = 0.0
    frequency_penalty: float | ArrayLike = 0.0
    eos_id: IntLike | Sequence[IntLike] | ArrayLike | None = None
    pad_id: IntLike | None = None
    stop: Sequence | None = None
    min_new: IntLike = 0
    bad_ids: Sequence[IntLike] | ArrayLike | None = None
    num_samples: IntLike | None = None

    def __post_init__(self):
        for name, check in _CHECKS.items():
            object.__setattr__(self, name, check(getattr(self, name), name))
        if self.max_new is not None and self.max_total is not None:
            raise ValueError(
                f"max_new={self.max_new} and max_total={self.max_total} are both set; pass "
                "one: max_new, the new tokens, or max_total, the prompt and the new tokens "
                "together (transformers' max_length)."
            )

    def new_tokens(self, prompt_len: int, who: str = "generate") -> int:
        """The most new tokens after a prompt of `prompt_len` tokens (the longest of a
        batch): `max_new`, else `max_total - prompt_len`.

        Raises a `ValueError` when neither is set, and when the prompt leaves no room under
        `max_total` (transformers refuses that prompt too).
        """
        if self.max_new is not None:
            return self.max_new
        if self.max_total is None:
            raise ValueError(
                f"{who} needs max_new, the most new tokens per row: pass max_new=..., or a "
                "config with max_new set (or max_total, the prompt and new tokens together)."
            )
        if prompt_len >= self.max_total:
            raise ValueError(
                f"max_total={self.max_total} (transformers' max_length: the prompt and the new "
                f"tokens together) leaves no new token after a prompt of {prompt_len} tokens; "
                "pass max_new=... (the new tokens alone), or a larger max_total."
            )
        return self.max_total - prompt_len

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "GenerationConfig":
        """Read transformers' `generation_config.json` (a file, or the folder holding it).

        `max_new_tokens` is `max_new`; without it, `max_length` is `max_total` (the prompt
        and new tokens together), and without either, `max_new` is 20, as transformers
        generates 20 new tokens by default. `do_sample: false` (transformers' default)
        reads as greedy, `temperature: 0`;
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
        file = check_path(path, "GenerationConfig.from_pretrained: path")
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
    # max_new and max_total are one setting in two spellings: the one passed replaces the
    # config's other (both passed is refused by the record).
    for name, other in (("max_new", "max_total"), ("max_total", "max_new")):
        if changes.get(name) is not None and other not in changes:
            changes[other] = None
    if not changes:
        return config
    # Plain numbers are kept with their type and repr (1, 1.0 and True hash alike; -0.0
    # and 0.0 compare equal), so a repeated call skips the checks of the same values.
    items = tuple((name, v, type(v), repr(v)) for name, v in changes.items())
    plain = all(type(v) in _PLAIN for v in changes.values())
    return (_replaced if plain and hashable(config) else _replace)(config, items)


def hashable(config: GenerationConfig) -> bool:
    """Whether `config` hashes (the caches of checked settings are keyed by it)."""
    try:
        hash(config)
    except TypeError:  # e.g. a `StopStrings` of unhashable parts
        return False
    return True


def _replace(config: GenerationConfig, items: tuple) -> GenerationConfig:
    return dataclasses.replace(config, **{name: value for name, value, *_ in items})


_replaced = functools.lru_cache(maxsize=128)(_replace)
_PLAIN = frozenset({type(None), int, float, bool})
_DEFAULT = GenerationConfig()
