"""The checks of the generation settings, one per field of `eqrope.GenerationConfig`.

Each takes the value and the name it came under, and returns the value in its one
canonical form or raises a `TypeError` / `ValueError` that names the setting and the fix.
"""

import math

import numpy as np

from .._checks import as_scalar, check_int, is_int, is_real
from ._stop_strings import StopStrings


def real(value, name: str, wanted: str) -> float:
    """A Python, NumPy or 0-d array real scalar as a float; anything else is refused by name."""
    if not is_real(value):
        raise TypeError(f"{name} must be {wanted}, got {value!r} ({type(value).__name__}).")
    return float(as_scalar(value))


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
    return isinstance(value, (list, tuple)) or (isinstance(value, np.ndarray) and value.ndim > 0) or (
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
    texts = [value] if isinstance(value, str) else list(value) if _is_sequence(value) else []
    at = next((i for i, t in enumerate(texts) if isinstance(t, str)), None)
    if at is not None:
        text, where = texts[at], name if isinstance(value, str) else f"{name}[{at}]"
        raise TypeError(
            f"{where} must be token ids, got the text {text!r}: pass tokenizer.eos_ids (an "
            "eqrope.Tokenizer's end ids), or that token's id, "
            f"tokenizer.encode({text!r}, add_special_tokens=False)."
        )
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
    if isinstance(value, StopStrings):
        return (value,)
    if isinstance(value, str) or not _is_sequence(value):
        raise TypeError(
            f"{name} must be a list of token-id sequences, like [[13, 13], [50256]] (or of "
            f"strings, for generate_text), got {value!r}."
        )
    entries = list(value)
    if not entries:
        raise ValueError(f"{name} is an empty list; pass None for no stop sequences.")
    if all(map(is_int, entries)):
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
        elif isinstance(entry, StopStrings):
            out.append(entry)
        elif _is_sequence(entry):
            out.append(_ids(entry, f"{name}[{i}]", "every stop sequence needs at least one token."))
        else:
            raise TypeError(
                f"{name}[{i}] must be a sequence of token ids, a string (generate_text) or an "
                f"eqrope.StopStrings, got {entry!r}."
            )
    return tuple(out)


def _int(minimum: int, none: bool):
    def check(value, name):
        return check_int(value, name, minimum=minimum, none=none)

    return check


_CHECKS = {
    "max_new": _int(0, none=True),
    "max_total": _int(1, none=True),
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
