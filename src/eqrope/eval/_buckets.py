"""The shapes of a pass: power-of-two length buckets (a new length within a bucket does not
recompile), rows rounded to the mesh, and the most rows whose pass fits the memory budget.
"""

import jax
import jax.numpy as jnp

from ..generation._arrays import split_model
from ._plain import plain_program


# The shortest bucket of a pass's inputs, and of a continuation under a shared prefix.
MIN_BUCKET = 16
MIN_CONTINUATION_BUCKET = 8


def bucket(n: int, cap: int, minimum: int = MIN_BUCKET) -> int:
    """The smallest power of two `>= max(n, minimum)`, at most `cap` (`n <= cap`)."""
    return min(max(minimum, 1 << (max(n, 1) - 1).bit_length()), cap)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# -- how many rows fit -------------------------------------------------------------------------


def rows_that_fit(model, width: int, *, limit: int, budget: int | None = None) -> int:
    """The most rows, a power of two at most `limit`, whose plain pass over `width` tokens
    fits in `budget` bytes (default `memory_budget()`).

    Measured, not guessed: the pass is compiled for 1 and 2 rows and XLA's memory analysis
    of each (arguments, outputs and temporaries) gives the fixed bytes (the weights) and
    the bytes per row (activations and the `(width, vocab)` logits). Returns 1 when the
    backend gives no analysis.
    """
    budget = memory_budget() if budget is None else budget
    arrays, structure = split_model(model)

    def nbytes(rows: int) -> int | None:
        ids = jax.ShapeDtypeStruct((rows, width), jnp.int32)
        ends = jax.ShapeDtypeStruct((rows,), jnp.int32)
        lowered = plain_program.lower(
            arrays, ids, ids, ends, ends, structure=structure, mesh=None, rules=None
        )
        m = lowered.compile().memory_analysis()
        if m is None:
            return None
        return (
            m.argument_size_in_bytes
            + m.output_size_in_bytes
            + m.temp_size_in_bytes
            - m.alias_size_in_bytes
        )

    one, two = nbytes(1), nbytes(2)
    if one is None or two is None:
        return 1
    per_row = max(two - one, 1)
    fits = max(1, (budget - (one - per_row)) // per_row)
    rows = 1
    while rows * 2 <= min(fits, limit):
        rows *= 2
    return rows


def memory_budget(device=None) -> int:
    """Bytes a pass may use on `device` (default JAX's first): 90% of what an accelerator
    has free (`memory_stats`), or on a CPU half of the host's available memory
    (`MemAvailable` of /proc/meminfo; 4 GiB where there is none)."""
    device = jax.devices()[0] if device is None else device
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        return int(0.9 * (stats["bytes_limit"] - stats.get("bytes_in_use", 0)))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 // 2
    except OSError:
        pass
    return 4 * 2**30
