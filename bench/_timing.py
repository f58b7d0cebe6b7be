"""Shared helpers for the benchmarks in bench/: machine facts, timing, JSON output.

Imported by the scripts in this folder (`from _timing import ...`: a script's own folder
is on `sys.path` when it runs as `python bench/x.py`).

Where results go: by default `bench/results/latest/`, which git ignores, so that a run
leaves the checkout clean; with `--save`, `bench/results/`, the committed results (to
update them on purpose).
"""

import argparse
import datetime
import importlib.metadata
import json
import os
import pathlib
import platform
import statistics
import sys
import time

import jax
import jax.monitoring


# Seconds JAX has spent tracing, lowering and compiling in this process, by stage; read
# before and after a call to split its first-call time into compile and run.
_COMPILE_EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace_s",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
    "/jax/core/compile/backend_compile_duration": "compile_s",
}
_compile_seconds = dict.fromkeys(_COMPILE_EVENTS.values(), 0.0)
# The functions XLA has compiled in this process, in order (one entry per compile).
_compiled: list[str] = []


def _on_duration(event: str, duration: float, **kwargs) -> None:
    stage = _COMPILE_EVENTS.get(event)
    if stage is not None:
        _compile_seconds[stage] += duration
    if stage == "compile_s":
        _compiled.append(str(kwargs.get("fun_name")))


jax.monitoring.register_event_duration_secs_listener(_on_duration)

# The committed results; a run without --save writes to LATEST, ignored by git.
RESULTS = pathlib.Path(__file__).resolve().parent / "results"
LATEST = RESULTS / "latest"


def add_output_arguments(parser: argparse.ArgumentParser, out_help: str) -> None:
    """`--out` (described by `out_help`) and `--save`, one or the other."""
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--out", type=pathlib.Path,
                       help=f"{out_help} (default bench/results/latest/, ignored by git)")
    where.add_argument("--save", action="store_true",
                       help="write into bench/results/, the committed results")


def results_folder(save: bool) -> pathlib.Path:
    """`bench/results/` with `--save`, else `bench/results/latest/` (ignored by git)."""
    return RESULTS if save else LATEST


def log(message: str) -> None:
    """A progress line on stderr (stdout holds the results table)."""
    print(message, file=sys.stderr, flush=True)


def compile_seconds() -> dict:
    """Cumulative seconds spent tracing, lowering to MLIR and XLA-compiling so far."""
    return dict(_compile_seconds)


def compiled_functions() -> list[str]:
    """The name of every function XLA has compiled so far in this process, in order
    (`jax.monitoring`'s `/jax/core/compile/backend_compile_duration` events)."""
    return list(_compiled)


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux, else `platform.processor()`)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_count() -> int:
    """CPUs this process may run on (the affinity mask where there is one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def cpu_caches() -> dict:
    """CPU cache sizes of cpu0 by level and type (Linux sysfs), e.g. `{"L3": "32768K"}`."""
    caches = {}
    for index in sorted(pathlib.Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level = (index / "level").read_text().strip()
            kind = (index / "type").read_text().strip()
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        suffix = {"Data": "d", "Instruction": "i"}.get(kind, "")
        caches[f"L{level}{suffix}"] = size
    return caches


def machine_info() -> dict:
    """Where and with what a benchmark ran: machine, CPU, versions, date, XLA backend."""
    devices = jax.devices()
    return {
        "machine": platform.node(),
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "cpu_count": cpu_count(),
        "cpu_caches": cpu_caches(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": _version("jaxlib"),
        "equinox": _version("equinox"),
        "numpy": _version("numpy"),
        "eqrope": _version("eqrope"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "backend": jax.default_backend(),
        "devices": [str(d) for d in devices],
        "x64": bool(jax.config.read("jax_enable_x64")),
    }


def time_call(fn, *, repeats: int, warmup: int = 1) -> dict:
    """Time `fn()` (no arguments), waiting for its results with `jax.block_until_ready`.

    The first call is timed on its own (`first_s`: compile plus run for a fresh program);
    then `warmup - 1` more untimed calls; then `repeats` timed calls. With `warmup=0`
    (for a program compiled beforehand) the first call is also the first repeat.

    **Returns:** a dict with `first_s`, `first_compile` (seconds of that first call spent
    tracing, lowering and compiling, from `jax.monitoring`), `first_compiles` (the number
    of XLA compiles in it), `median_s`, `min_s`, `max_s`, `times_s` (the repeats),
    `repeats`, `warmup`, and `result` (the last call's result, for checks; drop it before
    writing JSON).
    """
    return time_calls({"call": fn}, repeats=repeats, warmup=warmup)["call"]


def time_calls(fns: dict, *, repeats: int, warmup: int = 1) -> dict:
    """`time_call` for several functions at once, their calls interleaved round by round,
    so that load from other processes falls on all of them alike (compare ratios of
    functions timed in one `time_calls`).

    **Returns:** `{name: record}`, each record as `time_call` returns it.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}.")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}.")
    out = {}
    for name, fn in fns.items():
        before, compiles = compile_seconds(), len(_compiled)
        start = time.perf_counter()
        result = jax.block_until_ready(fn())
        first = time.perf_counter() - start
        after = compile_seconds()
        out[name] = {
            "first_s": first,
            "first_compile": {stage: after[stage] - before[stage] for stage in after},
            "first_compiles": len(_compiled) - compiles,
            "times_s": [] if warmup else [first],
            "result": result,
        }
    for _ in range(warmup - 1):
        for name, fn in fns.items():
            out[name]["result"] = jax.block_until_ready(fn())
    for _ in range(repeats if warmup else repeats - 1):
        for name, fn in fns.items():
            start = time.perf_counter()
            out[name]["result"] = jax.block_until_ready(fn())
            out[name]["times_s"].append(time.perf_counter() - start)
    for record in out.values():
        times = record["times_s"]
        record.update(median_s=statistics.median(times), min_s=min(times), max_s=max(times),
                      repeats=repeats, warmup=warmup)
    return out


def without_result(timing: dict) -> dict:
    """`timing` without its `result` entry, ready for JSON."""
    return {k: v for k, v in timing.items() if k != "result"}


def _jsonable(x):
    if hasattr(x, "tolist"):
        return x.tolist()
    if isinstance(x, pathlib.Path):
        return str(x)
    raise TypeError(f"cannot write {type(x).__name__} to JSON")


def write_json(path, data: dict) -> pathlib.Path:
    """Write `data` as indented JSON to `path`, creating its folder."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=2, default=_jsonable)
        f.write("\n")
    return path
