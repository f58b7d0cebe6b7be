"""What `generate_text(..., return_details=True)` gives per row: the text, its tokens, how
many, and why the row ended, as an OpenAI-style server reports them."""

import dataclasses
from collections.abc import Sequence
from typing import Literal

import numpy as np

from ..generation._settings import _stop
from ..generation._stop_strings import StopStrings, host_ends_with_text, text_table
from ..generation._stopping import host_ends_with_stop, stop_table


@dataclasses.dataclass(frozen=True)
class TextGeneration:
    """One row (or sample) of [`eqrope.generate_text`][] with `return_details=True`.

    - `text`: the new text, as `generate_text` returns it.
    - `token_ids`: the new tokens, the one that ended the row (an EOS id) included.
    - `num_new_tokens`: `len(token_ids)`, what OpenAI's `usage.completion_tokens` counts.
    - `finish_reason`: `"eos"` (an EOS id), `"stop"` (a stop string or token sequence was
      completed) or `"length"` (`max_new` tokens, or the cache is full).
    """

    text: str
    token_ids: tuple[int, ...]
    num_new_tokens: int
    finish_reason: Literal["eos", "stop", "length"]


def text_generation(
    text: str, prompt: np.ndarray, new: np.ndarray, eos_ids: Sequence[int], stop, min_new: int
) -> TextGeneration:
    """The details of a row whose `prompt` was followed by the tokens `new`; `stop` is the
    checked list `generate` ran with (token-id sequences and `StopStrings`)."""
    new = [int(t) for t in new]
    written = [int(t) for t in prompt] + new
    may_end = len(new) - 1 >= min_new  # the row's last token could end it
    if new and may_end and new[-1] in eos_ids:
        reason = "eos"
    elif new and may_end and _ends_with_a_stop(written, stop):
        reason = "stop"
    else:
        reason = "length"
    return TextGeneration(text, tuple(new), len(new), reason)


def _ends_with_a_stop(written: list[int], stop) -> bool:
    stop = _stop(stop, "stop") or ()
    sequences = [s for s in stop if not isinstance(s, StopStrings)]
    return host_ends_with_stop(written, stop_table(sequences)) or host_ends_with_text(
        written, text_table(stop)
    )
