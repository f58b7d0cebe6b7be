"""Importing bench/ scripts from the tests (bench/ is a folder of scripts, not a package)."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys


ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
# The environment of a smoke run of a bench script (its tiny or quick mode) in a
# subprocess: the suite's cheap code generation (conftest.py's flags: XLA's cheapest LLVM
# passes and its older loop emitters compile in well under half the time), and these
# tests check the figures' consistency, never a timing. .ci/run's tiny kv_cache run uses
# the same flags.
SMOKE_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
SMOKE_ENV = {**os.environ, "XLA_FLAGS": SMOKE_FLAGS}


def load(name: str):
    """Import a bench/ module by path; its own imports of bench/ modules find them there, as
    under `python bench/{name}.py`."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(BENCH))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


def smoke_run(
    script: str, mode: str, out: pathlib.Path, result: str, *extra: str, timeout: float = 600
) -> tuple[dict, str]:
    """Run `bench/{script}.py --{mode} *extra --out out` under `SMOKE_ENV`; return the JSON
    it wrote (`out / result`) and its stdout, after checking that it exited cleanly."""
    proc = subprocess.run(
        [sys.executable, str(BENCH / f"{script}.py"), f"--{mode}", *extra, "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=SMOKE_ENV,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / result).read_text()), proc.stdout


def load_child(job: dict, timeout: float = 300) -> dict:
    """Run bench/load.py's child on `job` (its `memory`, `time` and `generate` cases) in
    a fresh Python process, as the benchmark does; return its JSON record."""
    proc = subprocess.run(
        [sys.executable, str(BENCH / "load.py"), "child", json.dumps(job)],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
