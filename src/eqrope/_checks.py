"""Input checks, in one place.

Two kinds (STYLE.md rule 6): shape, type and config errors raise `TypeError`/`ValueError`
at trace time with a message that says the fix; value-dependent errors on traced arrays
(a token id out of range) go through `eqx.error_if`, whose result must be used.
"""

import math
import os
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np


def is_concrete(x) -> bool:
    """True when `x` has a value now (not a tracer inside `jit`/`grad`/`vmap`)."""
    return not isinstance(x, jax.core.Tracer)


def on_device(x):
    """`x` as a JAX array: `jax.device_put` for a NumPy array (no compile), else as is."""
    return x if isinstance(x, jax.Array) else jax.device_put(x)


def as_scalar(value):
    """The NumPy scalar a 0-d NumPy array or a concrete 0-d JAX array holds; any other
    `value` (a Python or NumPy scalar, a tracer, a list) as it is.

    Every number check unwraps with this first, so `np.array(3)` and `jnp.float32(0.5)`
    are the numbers they hold wherever eqrope takes a number."""
    if (
        not isinstance(value, np.generic)
        and getattr(value, "ndim", None) == 0
        and hasattr(value, "dtype")
        and is_concrete(value)
    ):
        return np.asarray(value)[()]
    return value


def is_int(value) -> bool:
    """True for a Python or NumPy integer or a 0-d integer array; False for a bool."""
    value = as_scalar(value)
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_real(value) -> bool:
    """True for a Python or NumPy int or float or a 0-d array of one; False for a bool."""
    value = as_scalar(value)
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
        value, (bool, np.bool_)
    )


def check_int(value, name: str, *, minimum: int | None = None, none: bool = False) -> int | None:
    """A Python or NumPy integer or a 0-d integer array (not a bool) that is
    `>= minimum`, returned as `int`.

    `none=True` lets `None` through unchanged. Every integer argument of eqrope's API
    goes through here, so they all refuse the same things with the same words.
    """
    if value is None and none:
        return None
    kind = {None: "an int", 1: "a positive int"}.get(
        minimum, f"an int >= {minimum}"
    )
    wanted = f"{name} must be {kind}{' or None' if none else ''}"
    if not is_int(value):
        raise TypeError(f"{wanted}, got {value!r} ({type(value).__name__}).")
    number = int(as_scalar(value))
    if minimum is not None and number < minimum:
        raise ValueError(f"{wanted}, got {value}.")
    return number


def check_float(value, name: str) -> float:
    """A finite real number (a Python or NumPy int or float, or a 0-d array of one; not a
    bool), as `float`.

    `np.float32(5e5)` becomes `500000.0`, exactly `float(value)`.
    """
    if not is_real(value):
        raise TypeError(
            f"{name} must be a finite number, got {value!r} ({type(value).__name__})."
        )
    try:
        number = float(as_scalar(value))
    except OverflowError:  # a Python int past float64's range
        number = math.inf
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number, got {value!r}.")
    return number


def check_path(value, name: str) -> Path:
    """A path (a `str` or `os.PathLike`), with `~` expanded and made absolute now, as a
    resolved `Path`: `"~/x"` is `$HOME/x`, not a folder named `~`, and a relative path
    means the working directory of the call, whatever `os.chdir` does later. Anything
    else (`5`, `None`, bytes, `""`) raises, naming `name`.
    """
    text = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not isinstance(text, str):
        raise TypeError(
            f"{name} must be a path (a str or os.PathLike such as pathlib.Path), got "
            f"{value!r} ({type(value).__name__})."
        )
    if not text:
        raise ValueError(f"{name} is an empty string; pass a path ('.' for this directory).")
    return Path(text).expanduser().resolve()


def not_local(given) -> str:
    """The end of the message for a path `given` that does not exist: eqrope reads local
    files only, and a hub id (`"HuggingFaceTB/SmolLM2-135M"`) must be downloaded first."""
    given = os.fspath(given)
    return (
        f"{given!r} is not a local file or directory. eqrope does not download checkpoints: "
        f"download a hub model first, with huggingface_hub.snapshot_download({given!r}) (which "
        f"returns the local folder) or `hf download {given}` (which prints it), and pass that "
        "folder."
    )


def check_bool(value, name: str) -> bool:
    """`True` or `False` (a NumPy bool becomes a `bool`); `"false"`, `0` or `None` raise."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(
            f"{name} must be True or False, got {value!r} ({type(value).__name__})."
        )
    return bool(value)


def check_choice(value, name: str, choices: tuple[str, ...]) -> str:
    """One of the strings `choices`; anything else (another string, a non-string) raises
    a `ValueError` that lists them."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}.")
    return value


def check_key(key, name: str = "key"):
    """One PRNG key, as a typed key: `jax.random.key(seed)` as it is, raw `uint32` key
    data (`jax.random.PRNGKey(seed)`) read with the default implementation (same bits).
    Anything else raises a `TypeError` naming `name`."""
    if not hasattr(key, "dtype") or not hasattr(key, "shape"):
        raise TypeError(
            f"{name} must be a PRNG key (jax.random.key(seed)), got {type(key).__name__}."
        )
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.shape != ():
            raise TypeError(f"{name} must be one PRNG key, got a key array of shape {key.shape}.")
        return key
    try:
        return jax.random.wrap_key_data(key)
    except (TypeError, ValueError):
        raise TypeError(
            f"{name} must be one PRNG key (jax.random.key(seed) or jax.random.PRNGKey(seed)), "
            f"got shape {key.shape} and dtype {key.dtype}."
        ) from None


_INT32 = np.iinfo(np.int32)


def as_int_array(x, name: str, *, ndim: int | tuple[int, ...], hint: str = ""):
    """Check that `x` holds integers of rank `ndim` and return it as int32.

    A concrete `x` (a list, NumPy or JAX array, not a tracer) is range-checked in its own
    dtype before the cast, so `2**32 + 5` is refused as itself instead of wrapping to 5,
    and it comes back as a NumPy array: no device work, no compile. A tracer comes back
    as an int32 tracer.
    """
    if isinstance(x, (list, tuple, int, np.integer)) and not isinstance(x, bool):
        x = _python_ints(x, name, hint)
    if not hasattr(x, "dtype") or not hasattr(x, "ndim"):
        raise TypeError(f"{name} must be an integer array, got {type(x).__name__}.")
    if x.dtype == jnp.bool_ or not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(
            f"{name} must hold integer token ids, got dtype {x.dtype}; "
            f"pass integers, e.g. {name}.astype(jnp.int32)."
        )
    ndims = (ndim,) if isinstance(ndim, int) else ndim
    if x.ndim not in ndims:
        raise ValueError(
            f"{name} must have rank {' or '.join(map(str, ndims))}, got shape {x.shape}.{hint}"
        )
    if not is_concrete(x):
        return x.astype(jnp.int32)
    values = np.asarray(x)
    bad = (values < _INT32.min) | (values > _INT32.max)
    if bad.any():
        raise ValueError(
            f"{name} holds integers outside the int32 range: {values[bad][:5].tolist()}; "
            "token ids, lengths and positions must fit in int32."
        )
    return values.astype(np.int32)


def _python_ints(x, name: str, hint: str = "") -> np.ndarray:
    """A list (or scalar) of Python ints as an int64 array, or a clear error."""
    try:
        return np.asarray(x, dtype=np.int64) if _all_ints(x) else np.asarray(x)
    except OverflowError:
        raise ValueError(
            f"{name} holds integers outside the int32 range (too large even for int64); "
            "token ids, lengths and positions must fit in int32."
        ) from None
    except ValueError:  # NumPy's "inhomogeneous shape": rows of different lengths
        raise ValueError(
            f"{name} is a ragged list (its rows have different lengths), not an array.{hint}"
        ) from None


def _all_ints(x) -> bool:
    if isinstance(x, (list, tuple)):
        return all(_all_ints(v) for v in x)
    return is_int(x)


def check_vocab(ids, vocab_size: int, name: str = "ids", *, valid=None):
    """Raise (inside or outside `jit`) if a token id is outside `[0, vocab_size)`.

    JAX's gather clamps out-of-range indices silently, so this check is what stops an
    embedding lookup from returning another token's row. `valid` (a boolean array of
    `ids`' shape, concrete) limits the check to those entries, e.g. the real tokens of a
    right-padded ragged batch.
    """
    if is_concrete(ids):
        values = np.asarray(ids)
        bad = (values < 0) | (values >= vocab_size)
        if valid is not None:
            bad &= np.asarray(valid)
        if bad.any():
            raise ValueError(
                f"{name} holds token ids outside [0, {vocab_size}): "
                f"{values[bad][:5].tolist()}; the vocabulary has {vocab_size} ids."
            )
        return ids
    return eqx.error_if(
        ids,
        (ids < 0) | (ids >= vocab_size),
        f"{name} holds a token id outside [0, vocab_size={vocab_size}).",
    )


def check_span(pos, seq: int, max_len: int, name: str = "pos"):
    """Check `0 <= pos` and `pos + seq <= max_len`; return `pos` as an int32 scalar."""
    if isinstance(pos, bool) or not (is_concrete(pos) or hasattr(pos, "dtype")):
        raise TypeError(f"{name} must be an integer position, got {pos!r}.")
    if hasattr(pos, "ndim") and pos.ndim != 0:
        raise TypeError(f"{name} must be a scalar integer position, got shape {pos.shape}.")
    message = (
        f"{name} + sequence length must be within max_len={max_len} and {name} >= 0 "
        f"(sequence length {seq}); the cache has {max_len} rows."
    )
    try:
        pos = as_int_array(pos, name, ndim=0)
    except TypeError:
        raise TypeError(f"{name} must be a scalar integer position, got {pos!r}.") from None
    except ValueError as e:
        raise ValueError(f"{message} {e}") from None
    if is_concrete(pos):
        value = int(pos)
        if value < 0 or value + seq > max_len:
            raise ValueError(message + f" Got {name}={value}.")
        return on_device(pos)
    return eqx.error_if(pos, (pos < 0) | (pos + seq > max_len), message)
