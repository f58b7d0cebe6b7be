"""Why a row ended, read on the host from its text by the rules of the device's `commit`
(`_state.py`): `generate_text`'s details and the engine's finish reasons both ask here."""

from collections.abc import Sequence
from typing import Literal

import numpy as np

from ._stop_strings import TextStops, host_ends_with_text
from ._stopping import host_ends_with_stop


def finish_reason(
    prompt: Sequence[int] | np.ndarray,
    new: Sequence[int] | np.ndarray,
    eos: Sequence[int] | np.ndarray,
    min_new: int,
    stop: np.ndarray,
    stop_text: TextStops,
) -> Literal["eos", "stop", "length"]:
    """`"eos"` when the row's last new token is one of `eos`, `"stop"` when its text ends
    in a stop sequence of the table `stop` or a stop string of `stop_text`, each only once
    `min_new` tokens came before that last token; else `"length"` (`max_new` tokens, or
    the cache was full). Padding entries of `eos` (negative ids) match nothing."""
    new = [int(t) for t in new]
    if not new or len(new) - 1 < min_new:
        return "length"
    if new[-1] in {int(e) for e in eos if int(e) >= 0}:
        return "eos"
    text = [int(t) for t in prompt] + new
    if host_ends_with_stop(text, stop) or host_ends_with_text(text, stop_text):
        return "stop"
    return "length"
