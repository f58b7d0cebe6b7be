"""What `generate_text(..., return_details=True)` gives per row: the text, its tokens, how
many, and why the row ended, as an OpenAI-style server reports them."""

import dataclasses
from collections.abc import Sequence
from typing import Literal

import numpy as np

from ..generation._finish import finish_reason
from ..generation._settings import _stop
from ..generation._stop_strings import StopStrings, text_table
from ..generation._stopping import stop_table


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
    stop = _stop(stop, "stop") or ()
    sequences = [s for s in stop if not isinstance(s, StopStrings)]
    reason = finish_reason(prompt, new, eos_ids, min_new, stop_table(sequences), text_table(stop))
    return TextGeneration(text, tuple(int(t) for t in new), len(new), reason)
