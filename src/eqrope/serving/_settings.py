"""One request's settings as a row of the slots' arrays, padded to the engine's capacities.

The checks are `generate`'s own (`GenerationConfig`, `eqrope.generation._request.sampling_of`):
a setting means the same in both. The engine adds the capacities, the sizes of the
per-request id lists and stop-string tables that the compiled programs hold; a request
past one is refused with the engine argument that raises it.
"""

import dataclasses
import math

import jax
import numpy as np

from .._checks import as_int_array, check_int, check_key
from .._custom_types import IntLike
from ..generation import GenerationConfig
from ..generation._generation_config import resolve
from ..generation._hf_generation_config import refuse_hf_keywords
from ..generation._request import sampling_of
from ..generation._sampling import Sampling
from ..generation._stop_strings import NO_TEXT_STOPS_TINY, StopStrings, text_table
from ..generation._stopping import ANY, NONE


@dataclasses.dataclass(frozen=True)
class Capacities:
    """The most ids one request may carry: EOS ids, banned ids, stop sequences and the
    tokens of the longest one; and its stop strings, the bytes of the longest one and the
    tokens that can take part in a match (0 stop strings: none, at no cost). They are
    shapes of the compiled programs."""

    eos_ids: IntLike = 8
    bad_ids: IntLike = 64
    stop: IntLike = 8
    stop_len: IntLike = 8
    stop_strings: IntLike = 0
    stop_string_bytes: IntLike = 16
    stop_string_tokens: IntLike = 256

    def __post_init__(self):
        for field in dataclasses.fields(self):
            minimum = 0 if field.name == "stop_strings" else 1
            value = check_int(getattr(self, field.name), f"max_{field.name}", minimum=minimum)
            object.__setattr__(self, field.name, value)

    @property
    def text_shape(self) -> tuple[int, int, int]:
        """The `(tokens, strings, bytes)` of every slot's stop-string table: the
        capacities in powers of two, as `text_stops` sizes a table."""
        sizes = (self.stop_string_tokens, self.stop_strings, self.stop_string_bytes)
        return tuple(1 << (max(n, 1) - 1).bit_length() for n in sizes)


def request_sampling(config: GenerationConfig, vocab: int, caps: Capacities) -> Sampling:
    """The checked `Sampling` of one request, its id lists padded to `caps` (NumPy)."""
    if not caps.stop_strings and any(isinstance(s, StopStrings) for s in config.stop or ()):
        raise ValueError(
            "stop holds an eqrope.StopStrings, but the engine was built without stop strings; "
            "build the Engine with max_stop_strings=1 or more (docs/serving.md), or match "
            "strings on the text as the server does (TextStream, then Engine.cancel)."
        )
    sampling, eos_ids = sampling_of(config, vocab)
    bad = [int(i) for i in np.asarray(sampling.bad) if i >= 0]
    stop = [list(s) for s in (config.stop or ()) if not isinstance(s, StopStrings)]
    text = text_table(config.stop, caps.text_shape) if caps.stop_strings else NO_TEXT_STOPS_TINY
    spelled = np.asarray(text.target)[np.asarray(text.target) <= np.shape(text.at)[-1]]
    sizes = (
        ("eos_id", len(eos_ids), caps.eos_ids, "max_eos_ids", "EOS ids"),
        ("bad_ids", len(bad), caps.bad_ids, "max_bad_ids", "ids"),
        ("stop", len(stop), caps.stop, "max_stop", "sequences"),
        ("stop", max(map(len, stop), default=0), caps.stop_len, "max_stop_len", "tokens in a sequence"),
        ("stop", len(spelled), caps.stop_strings, "max_stop_strings", "stop strings"),
        ("stop", max(spelled, default=0), caps.stop_string_bytes, "max_stop_string_bytes", "bytes in a stop string"),
        (
            "stop", int(np.sum(np.asarray(text.length) > 0)), caps.stop_string_tokens,
            "max_stop_string_tokens", "token ids that can take part in a stop string's match",
        ),
    )  # fmt: skip
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
        stop_text=text,
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


def sample_keys(key, samples: int | None, most: int) -> list[np.ndarray]:
    """Each sample's key data, as `generate` derives it for a 1-D prompt: the key itself,
    or `jax.random.split(key, n)[j]` for sample `j` of `num_samples=n` (`n <= most`).

    With JAX's partitionable threefry (its default), `split(key, n)[j]` does not depend on
    `n`, so every `n` takes the first `n` keys of one `split(key, most)`: one compiled split
    for every sample count, not one per count. Other key kinds split with `n` itself.
    """
    key = check_key(key)
    if samples is None:
        return [np.asarray(jax.random.key_data(key), np.uint32)]
    keys = jax.random.split(key, most if _split_is_prefix(key) else samples)
    return list(np.asarray(jax.random.key_data(keys), np.uint32)[:samples])  # sliced on the host


def _split_is_prefix(key) -> bool:
    """Whether `split(key, n)` is the first `n` keys of `split(key, m)` for `m >= n`."""
    return bool(jax.config.jax_threefry_partitionable) and str(jax.random.key_impl(key)) == "threefry2x32"


def request_config(prompt, config, settings: dict, vocab: int, max_len: int) -> tuple[np.ndarray, GenerationConfig]:
    """`Engine.submit`'s checked prompt and settings: `config` with `settings` (its fields
    as keywords) over it, `max_new` from `max_total` once the prompt's length is known."""
    refuse_hf_keywords(settings, "Engine.submit")
    unknown = sorted(set(settings) - {f.name for f in dataclasses.fields(GenerationConfig)})
    if unknown:
        raise TypeError(
            f"Engine.submit got unknown settings {unknown}; the settings are "
            "GenerationConfig's fields (docs/generation.md)."
        )
    config = resolve(config, settings)
    if config.max_new is None:
        length = len(check_prompt(prompt, vocab, max_len, 0))
        config = resolve(config, {"max_new": config.new_tokens(length, "Engine.submit")})
    return check_prompt(prompt, vocab, max_len, config.max_new), config


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

