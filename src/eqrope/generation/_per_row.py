"""Settings per row of a batch: `generate(model, prompts, [4, 9], temperature=[0.0, 0.8])`.

A setting of `PER_ROW` given as a sequence (a list, a tuple, a 1-D NumPy or JAX array)
holds one value per row of a `(batch, seq)` prompt. Each value is checked by the
setting's own check, named by its row (`temperature[2]`); each row's settings become a
`GenerationConfig`, and their `Sampling` records are stacked on a leading rows axis
(`stack_rows`, the engine's slots' layout). The program then chooses each row's token
with `choose_rows` and ends each row at its own `max_new`; the values are traced, so new
values of the same batch do not recompile.
"""

import jax
import numpy as np

from ._generation_config import GenerationConfig, _FromConfig, resolve
from ._request_checks import UNDER_JIT
from ._sampling import Sampling, stack_rows
from ._settings import _CHECKS


PER_ROW = (
    "max_new", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
    "presence_penalty", "frequency_penalty", "min_new",
)  # fmt: skip

# Values that hold no array: `generate`'s defaults (`FROM_CONFIG`), `None`, numbers.
_PLAIN = frozenset({_FromConfig, type(None), int, float, bool})


def _is_rows(value) -> bool:
    return isinstance(value, (list, tuple)) or (
        not isinstance(value, np.generic) and (getattr(value, "ndim", 0) or 0) >= 1
    )


def split_rows(given: dict) -> tuple[dict, dict[str, tuple]]:
    """`generate`'s settings `given` (name to value), split into those for every row and
    those per row (name to each row's checked value).

    Refused: a traced value (`generate` under `jax.jit` or `jax.vmap`), with a `TypeError`
    that points to per-row arrays; a per-row setting that is empty or not 1-D; a row's
    value that its setting's check refuses, named by its row (`temperature[3] must be
    >= 0`).
    """
    for name, value in given.items():
        if type(value) in _PLAIN:  # most settings: nothing to walk
            continue
        if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(value)):
            raise TypeError(UNDER_JIT.format(name=name))
    shared = {k: v for k, v in given.items() if k not in PER_ROW or not _is_rows(v)}
    rows = {}
    for name in given.keys() - shared.keys():
        value = given[name]
        if np.ndim(value) != 1 or len(value) == 0:
            raise ValueError(
                f"{name} must be one value for every row, or a (batch,) sequence of one value "
                f"per row of a (batch, seq) prompt; got shape {np.shape(value)}."
            )
        values = value if isinstance(value, (list, tuple)) else np.asarray(value).tolist()
        rows[name] = tuple(_CHECKS[name](v, f"{name}[{i}]") for i, v in enumerate(values))
    return shared, rows


def refuse_config_list(config) -> None:
    """A `TypeError` for a list of configs, one per row, that says to pass the settings
    per row instead."""
    if isinstance(config, (list, tuple)):
        raise TypeError(
            f"config must be one eqrope.GenerationConfig for the whole call, got a "
            f"{type(config).__name__}. For settings that differ per row, pass (batch,) arrays "
            f"of them to generate with a (batch, seq) prompt: {', '.join(PER_ROW)} "
            "(temperature=[0.0, 0.8], max_new=[16, 64])."
        )


def row_configs(
    settings: GenerationConfig, rows: dict[str, tuple], batched: bool, batch: int
) -> list[GenerationConfig]:
    """The settings of each row of a prompt of `batch` rows: `settings` with each row's
    values of `rows` (`split_rows`); `[settings]` without per-row values.

    Refused (`ValueError`): per-row values with a 1-D prompt, or not one per row.
    """
    if not rows:
        return [settings]
    for name, values in rows.items():
        given = f"{name} has {len(values)} value{'s' * (len(values) != 1)}, one per row"
        if not batched:
            raise ValueError(
                f"{given}, but the prompt is 1-D (one row): pass one {name}, or a (batch, "
                "seq) prompt with one row per value."
            )
        if len(values) != batch:
            raise ValueError(
                f"{given}, but the prompt has {batch} rows: pass {batch} values (or one "
                f"{name} for every row)."
            )
    return [resolve(settings, {name: values[i] for name, values in rows.items()}) for i in range(batch)]


def rows_sampling(samplings: list[Sampling], samples: int | None) -> Sampling:
    """The stacked settings of the program's rows, from each prompt's `Sampling`: each
    repeated `samples` times (sample-minor, as the rows are)."""
    return stack_rows([s for s in samplings for _ in range(samples or 1)])
