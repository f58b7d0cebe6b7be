"""The checks of one request field each: a JSON value in, a plain value out, or a 400 that
names the field and says what it takes.

JSON has one number type and `true` is not a number here: `"n": true` and `"max_tokens":
16.5` are refused, as OpenAI refuses them, rather than read as 1 and 16.
"""

import math

from ._errors import bad_field


MISSING = object()


def get(body: dict, name: str, default=None):
    """`body[name]`, with `null` read as absent (OpenAI's clients send `null` for unset)."""
    value = body.get(name, MISSING)
    return default if value is MISSING or value is None else value


def integer(body: dict, name: str, default=None, *, low: int | None = None, high: int | None = None):
    value = get(body, name, MISSING)
    if value is MISSING:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_field(name, f"{name} must be an integer, got {_show(value)}.")
    _bounds(name, value, low, high)
    return value


def number(body: dict, name: str, default=None, *, low=None, high=None, low_open=False):
    value = get(body, name, MISSING)
    if value is MISSING:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_field(name, f"{name} must be a finite number, got {_show(value)}.")
    if low_open and low is not None and value <= low:
        raise bad_field(name, f"{name} must be > {low}, got {value}.")
    _bounds(name, value, None if low_open else low, high)
    return float(value)


def boolean(body: dict, name: str, default: bool = False) -> bool:
    value = get(body, name, MISSING)
    if value is MISSING:
        return default
    if not isinstance(value, bool):
        raise bad_field(name, f"{name} must be true or false, got {_show(value)}.")
    return value


def string(body: dict, name: str, default=None):
    value = get(body, name, MISSING)
    if value is MISSING:
        return default
    if not isinstance(value, str):
        raise bad_field(name, f"{name} must be a string, got {_show(value)}.")
    return value


def strings(body: dict, name: str) -> tuple[str, ...]:
    """A string or a list of non-empty strings (`stop`)."""
    value = get(body, name, [])
    value = [value] if isinstance(value, str) else value
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise bad_field(name, f"{name} must be a non-empty string or a list of them, got {_show(value)}.")
    return tuple(dict.fromkeys(value))


def token_ids(value, name: str, vocab: int) -> list[int]:
    """A list of token ids in `[0, vocab)`."""
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise bad_field(name, f"{name} must be a list of token ids (integers), got {_show(value)}.")
    outside = [t for t in value if not 0 <= t < vocab]
    if outside:
        raise bad_field(
            name, f"{name} holds token ids outside the vocabulary [0, {vocab}): {outside[:5]}."
        )
    return value


def refuse_unknown(body: dict, known: set[str]) -> None:
    """OpenAI's own answer to a field it does not know: a 400 naming it."""
    unknown = sorted(set(body) - known)
    if unknown:
        raise bad_field(
            unknown[0],
            f"Unrecognized request argument supplied: {', '.join(unknown)}. This server takes "
            f"{', '.join(sorted(known))}.",
        )


def only(body: dict, name: str, allowed, says: str) -> None:
    """A field eqrope does not implement, accepted only at a value that changes nothing."""
    value = get(body, name, MISSING)
    if value is not MISSING and value not in allowed:
        raise bad_field(name, f"{name}={_show(value)} is not supported: {says}")


def _bounds(name, value, low, high) -> None:
    if (low is not None and value < low) or (high is not None and value > high):
        lo = "-inf" if low is None else low
        hi = "inf" if high is None else high
        raise bad_field(name, f"{name} must be in [{lo}, {hi}], got {value}.")


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
