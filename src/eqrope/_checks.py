"""Input checks, in one place.

Two kinds (STYLE.md rule 6): shape, type and config errors raise `TypeError`/`ValueError`
at trace time with a message that says the fix; value-dependent errors on traced arrays
(a token id out of range) go through `eqx.error_if`, whose result must be used.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np


def is_concrete(x) -> bool:
    """True when `x` has a value now (not a tracer inside `jit`/`grad`/`vmap`)."""
    return not isinstance(x, jax.core.Tracer)


def check_int(value, name: str, *, minimum: int | None = None, none: bool = False) -> int | None:
    """A Python or NumPy integer (not a bool) that is `>= minimum`, returned as `int`.

    `none=True` lets `None` through unchanged. Every integer argument of eqrope's API
    goes through here, so they all refuse the same things with the same words.
    """
    if value is None and none:
        return None
    kind = {None: "an int", 1: "a positive int"}.get(
        minimum, f"an int >= {minimum}"
    )
    wanted = f"{name} must be {kind}{' or None' if none else ''}"
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{wanted}, got {value!r} ({type(value).__name__}).")
    if minimum is not None and value < minimum:
        raise ValueError(f"{wanted}, got {value}.")
    return int(value)


def as_int_array(x, name: str, *, ndim: int | tuple[int, ...], hint: str = ""):
    """Check that `x` holds integers of rank `ndim` and return it as an int32 array."""
    if isinstance(x, (list, tuple)):
        x = np.asarray(x)
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
    return jnp.asarray(x).astype(jnp.int32)


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
    if isinstance(pos, bool):
        raise TypeError(f"{name} must be an integer position, got {pos!r}.")
    pos_arr = jnp.asarray(pos)
    if pos_arr.ndim != 0 or not jnp.issubdtype(pos_arr.dtype, jnp.integer):
        raise TypeError(f"{name} must be a scalar integer position, got {pos!r}.")
    pos_arr = pos_arr.astype(jnp.int32)
    message = (
        f"{name} + sequence length must be within max_len={max_len} and {name} >= 0 "
        f"(sequence length {seq}); the cache has max_len rows."
    )
    if is_concrete(pos_arr):
        value = int(np.asarray(pos_arr))
        if value < 0 or value + seq > max_len:
            raise ValueError(message + f" Got {name}={value}.")
        return pos_arr
    return eqx.error_if(pos_arr, (pos_arr < 0) | (pos_arr + seq > max_len), message)
