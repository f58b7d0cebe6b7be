"""The log line of a generate program's compile, naming what made it a new program.

A generate program is compiled once per shape and static setting. The first line of a
process names the shapes. Each later one names the settings in which it differs from the
closest program compiled before (`batch 1 -> 4`, `check_finite True -> False`, the
model's layout, the PRNG implementation, ...), so two lines never read alike for two
different programs, and a line never reads as a program compiling twice.
"""

import threading

import jax
import numpy as np

from .._log import compiling
from ._constraint import capacity


# What compiled so far in this process, per program name: each program's settings.
_SEEN: dict[str, list[dict[str, str]]] = {}
_LOCK = threading.Lock()

_NAMES = {
    "chunk": "prefill_chunk",
    "samples": "num_samples",
    "stream": "the on_token callback",
    "differentiable": "under jax.grad",
    "draft_len": "draft_len",
    "rule": "accept",
}


def settings_of(arrays, structure, args, static) -> dict[str, str]:
    """Each shape and static setting of a generate program, as text."""
    buffer, _, _, sampling, key, *_ = args
    constraint = static.get("constraint")
    batch, length = buffer.shape
    out = {"batch": str(batch), "cache length": str(length)}
    for name, value in static.items():
        if name not in ("batched", "mesh", "rules", "constraint"):
            out[_NAMES.get(name, name)] = str(value)
    out["mesh"] = "none" if static.get("mesh") is None else str(dict(static["mesh"].shape))
    out["sharding rules"] = "none" if static.get("rules") is None else "given"
    out["a 1-D prompt"] = str(not static.get("batched", True))
    out["the model's layout (stacked or per-block weights, or another architecture)"] = _digest(structure)
    out["the model's array shapes and dtypes"] = _digest(
        [(np.shape(a), str(a.dtype)) for a in jax.tree.leaves(arrays)]
    )
    out["the PRNG implementation"] = str(getattr(key, "dtype", type(key).__name__))
    out["settings per row"] = str(np.ndim(sampling.temperature) == 1)
    out["the constraint capacity (states x exceptions)"] = (
        "none" if constraint is None else "x".join(map(str, capacity(constraint.table)))
    )
    # The size buckets of the id lists, without the rows axis of settings per row.
    sizes = {
        "eos_id": (sampling.eos, 1), "bad_ids": (sampling.bad, 1), "stop": (sampling.stop, 2),
        "stop strings": (sampling.stop_text.at, 3),
    }  # fmt: skip
    for name, (array, rank) in sizes.items():
        out[f"the size bucket of {name}"] = "x".join(map(str, np.shape(array)[-rank:]))
    return out


def _digest(value) -> str:
    return format(hash(str(value)) & 0xFFFFFFFF, "08x")


def compiling_generate(program: str, arrays, structure, args, static) -> None:
    """Log the compile of `program` (call it while JAX traces it): its shapes, then what
    differs from the closest program of the same name compiled before."""
    settings = settings_of(arrays, structure, args, static)
    shapes = f"batch {settings['batch']}, cache length {settings['cache length']}"
    if static.get("samples") is not None:
        shapes += f", {static['samples']} samples per prompt"
    if static.get("draft_len") is not None:
        shapes += f", draft_len {static['draft_len']}"
    with _LOCK:
        seen = _SEEN.setdefault(program, [])
        before = min(seen, key=lambda s: sum(s.get(k) != v for k, v in settings.items()), default=None)
        seen.append(settings)
    if before is None:
        compiling("generation", program, shapes, "batch, cache length, num_samples or static setting")
        return
    changed = [k for k, v in settings.items() if before.get(k) != v]
    why = "; ".join(_change(k, before.get(k), settings[k]) for k in changed)
    why = why or "the same settings again (JAX's caches were cleared)"
    compiling("generation", program, f"{shapes}; new: {why}", "combination of these")


def _change(name: str, old, new) -> str:
    if name.startswith("the model's"):
        return f"{name}: changed"
    return f"{name} {old} -> {new}"
