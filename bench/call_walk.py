"""Walk `generate`'s `model` argument through eqrope's modules, and count the climbs.

Traces one first call of `eqrope.generate` (plain, then speculative with prompt lookup)
and records every call into an eqrope function whose frame holds the model (any local
that is a `RotaryDecoder`: the model, or its rebuilt copy inside the trace), with the
eqrope module nearest above it on the stack as its caller. A *stay* is a run of such
calls in one module. Each module's *floor* is the length of its longest chain of eqrope
imports; a call from one module into another whose floor is not below the caller's is a
*climb*: a call against the direction of the imports, or sideways between two modules.
"""

import ast
import functools
import pathlib
import sys

import jax
import numpy as np

import eqrope

ROOT = pathlib.Path(eqrope.__file__).parent


def _imports() -> dict[str, set[str]]:
    graph = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                deps.add(target)
        graph[name] = deps
    return graph


GRAPH = _imports()


@functools.cache
def floor(module: str) -> int:
    deps = [d for d in GRAPH.get(module, ()) if d in GRAPH and not d.endswith("__init__")]
    return 1 + max((floor(d) for d in deps if d != module), default=0)


def _caller(frame):
    frame = frame.f_back
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.startswith("eqrope"):
            return name
        frame = frame.f_back
    return None


def walk(call):
    stays, climbs = [], []

    def tracer(frame, event, arg):
        if event != "call":
            return None
        name = frame.f_globals.get("__name__", "")
        if not name.startswith("eqrope") or name == "eqrope.testing":
            return None
        if not any(isinstance(v, eqrope.RotaryDecoder) for v in frame.f_locals.values()):
            return None
        caller = _caller(frame)
        if not stays or stays[-1] != name:
            stays.append(name)
            if caller is not None and caller != name and floor(name) >= floor(caller):
                climbs.append(f"{caller} -> {name}")
        return None

    sys.settrace(tracer)
    try:
        call()
    finally:
        sys.settrace(None)
    return stays, climbs


if __name__ == "__main__":
    model = eqrope.RotaryDecoder(65, 64, 4, 2, 256, key=jax.random.key(0))
    prompt = np.arange(8)
    for label, kwargs in (("plain", {}), ("speculative", {"draft": "prompt_lookup"})):
        stays, climbs = walk(lambda: eqrope.generate(model, prompt, 16, **kwargs))
        print(f"{label}: {len(stays)} stays in {len(set(stays))} modules, {len(climbs)} climbs")
        print("  " + " -> ".join(f"{s.replace('eqrope.', '')}[{floor(s)}]" for s in stays))
        for c in climbs:
            print("  climb:", c)
