"""One request's settings as a row of the slots' arrays, padded to the engine's capacities.

The checks are `generate`'s own (`GenerationConfig`, `eqrope.generation._request.sampling_of`):
a setting means the same in both. The engine adds the capacities, the sizes of the
per-request id lists that the compiled programs hold; a request past one is refused with
the engine argument that raises it.
"""

import dataclasses
import math

import jax
import numpy as np

from .._checks import as_int_array, check_int, check_key
from .._custom_types import IntLike
from ..generation import GenerationConfig
from ..generation._request import sampling_of
from ..generation._sampling import Sampling
from ..generation._stop_strings import NO_TEXT_STOPS_TINY, StopStrings
from ..generation._stopping import ANY, NONE


@dataclasses.dataclass(frozen=True)
class Capacities:
    """The most ids one request may carry: EOS ids, banned ids, stop sequences and the
    tokens of the longest one. They are shapes of the compiled programs."""

    eos_ids: IntLike = 8
    bad_ids: IntLike = 64
    stop: IntLike = 8
    stop_len: IntLike = 8

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = check_int(getattr(self, field.name), f"max_{field.name}", minimum=1)
            object.__setattr__(self, field.name, value)


def request_sampling(config: GenerationConfig, vocab: int, caps: Capacities) -> Sampling:
    """The checked `Sampling` of one request, its id lists padded to `caps` (NumPy)."""
    if any(isinstance(s, StopStrings) for s in config.stop or ()):
        raise ValueError(
            "stop holds an eqrope.StopStrings; the engine matches token-id stop sequences. "
            "Match strings on the text as the server does (serving.server's TextStream, then "
            "Engine.cancel), or pass token-id sequences."
        )
    sampling, eos_ids = sampling_of(config, vocab)
    bad = [int(i) for i in np.asarray(sampling.bad) if i >= 0]
    stop = [list(s) for s in (config.stop or ())]
    sizes = (
        ("eos_id", len(eos_ids), caps.eos_ids, "max_eos_ids", "EOS ids"),
        ("bad_ids", len(bad), caps.bad_ids, "max_bad_ids", "ids"),
        ("stop", len(stop), caps.stop, "max_stop", "sequences"),
        ("stop", max(map(len, stop), default=0), caps.stop_len, "max_stop_len", "tokens in a sequence"),
    )
    for name, size, cap, argument, what in sizes:
        if size > cap:
            raise ValueError(
                f"{name} has {size} {what}, more than the engine holds ({cap}); build the "
                f"Engine with {argument}={size} or more."
            )
    return sampling._replace(
        eos=_padded(eos_ids, caps.eos_ids),
        bad=_padded(bad, caps.bad_ids),
        stop=stop_rows(stop, caps.stop, caps.stop_len),
        stop_text=NO_TEXT_STOPS_TINY,
    )


def _padded(ids: list[int], size: int) -> np.ndarray:
    out = np.full((size,), -1, np.int32)
    out[: len(ids)] = ids
    return out


def stop_rows(stop: list[list[int]], rows: int, width: int) -> np.ndarray:
    """`_stopping.stop_table`'s layout at a fixed `(rows, width)`: each sequence right-
    aligned, `ANY` on its left, spare rows `NONE` (which no token equals)."""
    table = np.full((rows, width), ANY, np.int32)
    table[len(stop) :] = NONE
    for i, sequence in enumerate(stop):
        table[i, width - len(sequence) :] = sequence
    return table


def idle_sampling(vocab: int, caps: Capacities) -> Sampling:
    """The settings of an empty slot: greedy, nothing banned, no stop sequence."""
    return request_sampling(GenerationConfig(max_new=1), vocab, caps)


def sample_keys(key, samples: int | None) -> list[np.ndarray]:
    """Each sample's key data, as `generate` derives it for a 1-D prompt: the key itself,
    or `jax.random.split(key, n)[j]` for sample `j` of `num_samples=n`."""
    key = check_key(key)
    keys = [key] if samples is None else list(jax.random.split(key, samples))
    return [np.asarray(jax.random.key_data(k), np.uint32) for k in keys]


def check_prompt(prompt, vocab: int, max_len: int, max_new: int, name: str = "prompt") -> np.ndarray:
    """A 1-D prompt of ids below `vocab` that, with `max_new` new tokens, fits `max_len`."""
    ids = as_int_array(prompt, name, ndim=1, hint=" Pass one prompt of token ids (a 1-D array).")
    if ids.shape[0] == 0:
        raise ValueError(f"{name} is empty; pass at least one token.")
    out = ids[(ids < 0) | (ids >= vocab)]
    if out.size:
        raise ValueError(f"{name} holds ids outside [0, {vocab}): {out[:5].tolist()}.")
    if ids.shape[0] + max_new > max_len:
        raise ValueError(
            f"{name} has {ids.shape[0]} tokens and max_new={max_new}, {ids.shape[0] + max_new} "
            f"positions, but the engine holds max_len={max_len}; shorten the prompt, lower "
            f"max_new, or build the Engine with a larger max_len."
        )
    return np.asarray(ids, np.int32)


def check_buckets(buckets, slots: int) -> tuple[int, ...]:
    """The engine's decode slot counts, sorted (default: powers of two up to `slots`);
    each in `[1, slots]`, and `slots` among them."""
    out = tuple(sorted(check_int(b, f"decode_buckets[{i}]") for i, b in enumerate(buckets or powers(1, slots))))
    if out[-1] != slots or out[0] < 1:
        raise ValueError(f"decode_buckets={buckets} must be slot counts in [1, slots={slots}], slots among them.")
    return out


def powers(low: int, high: int) -> tuple[int, ...]:
    """`low, 2 low, 4 low, ...` below `high`, then `high`."""
    sizes = [low * 2**k for k in range(max(0, math.ceil(math.log2(high / low))))]
    return tuple(s for s in sizes if s < high) + (high,)

