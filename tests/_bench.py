"""Importing bench/ scripts from the tests (bench/ is a folder of scripts, not a package)."""

import importlib.util
import os
import pathlib


ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
# The environment of a smoke run of a bench script (its tiny or quick mode) in a
# subprocess: XLA's cheapest code generation compiles in about two thirds of the time,
# and these tests check the figures' consistency, never a timing.
SMOKE_ENV = {**os.environ, "XLA_FLAGS": "--xla_backend_optimization_level=0"}


def load(name: str):
    """Import a bench/ module by path."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
