"""Importing bench/ scripts from the tests (bench/ is a folder of scripts, not a package)."""

import importlib.util
import pathlib


ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"


def load(name: str):
    """Import a bench/ module by path."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
