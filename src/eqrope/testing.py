"""Aids for tests and benchmarks, kept out of the top-level API: `import eqrope.testing`.

- [`eqrope.testing.Uncached`][]: a model without its cache methods, so that
  [`eqrope.generate`][] takes the uncached reference path.
- [`eqrope.testing.hlo_instructions`][]: the instructions of a compiled program's text,
  one record each (computation, name, dtype, shape, opcode).
- [`eqrope.testing.hlo_collectives`][]: which collectives a compiled program runs, and
  over which mesh axes.

`hlo_collectives` reads the text of a compiled XLA program (`jax.jit(f).lower(...).compile().as_text()`) and
counts each collective instruction by the mesh axes its replica groups span, so a test or
a reader can check, say, that a data-parallel train step all-reduces its gradients over
`"data"` and nothing else.
"""

import re
from collections import Counter
from collections.abc import Iterator
from typing import NamedTuple

import equinox as eqx
import numpy as np

from .model._decoder import RotaryDecoder


class Uncached(eqx.Module):
    """A decoder seen only as `ids -> logits`, with `max_len` and `vocab_size`.

    It has no cache methods, so [`eqrope.generate`][] takes the uncached reference path:
    the whole text runs again for every new token (the seed page's `Plain`, as a pytree).
    """

    model: RotaryDecoder

    @property
    def max_len(self) -> int:
        return self.model.max_len

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    def __call__(self, ids):
        return self.model(ids)


class HloInstruction(NamedTuple):
    """One instruction of an HLO text, `%name = dtype[shape]{layout} opcode(operands), ...`."""

    computation: str | None  # the enclosing computation; None outside any header
    name: str
    dtype: str | None  # None for a tuple-shaped result
    shape: tuple[int, ...] | None  # None for a tuple-shaped result
    opcode: str
    line: str


_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) .*\{$")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]\S*")
_OPCODE = re.compile(r"([a-z][\w-]*)\(")


def hlo_instructions(hlo_text: str) -> Iterator[HloInstruction]:
    """The instructions of an HLO text, in order, with the computation each belongs to.

    **Arguments:**

    - `hlo_text`: a program's text, e.g. `jax.jit(f).lower(*args).compile().as_text()`.

    **Returns:** an iterator of `HloInstruction(computation, name, dtype, shape, opcode,
    line)`, e.g. `("main.3", "copy.1", "f32", (512, 2, 8), "copy", line)` for
    `%copy.1 = f32[512,2,8]{2,1,0} copy(%p)` inside `ENTRY %main.3 (...) -> ... {`.
    Names drop their `%`; lines that are not instructions are skipped.
    """
    computation = None
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header is not None:
            computation = header.group(1)
            continue
        left, sep, rest = line.partition(" = ")
        if not sep:
            continue
        name = left.strip().removeprefix("ROOT ").removeprefix("%")
        dtype = shape = None
        if rest.startswith("("):  # a tuple shape: skip to its closing parenthesis
            depth = 0
            for i, char in enumerate(rest):
                depth += {"(": 1, ")": -1}.get(char, 0)
                if depth == 0:
                    rest = rest[i + 1 :]
                    break
        else:
            array = _ARRAY.match(rest)
            if array is not None:
                dtype = array.group(1)
                shape = tuple(int(d) for d in array.group(2).split(",") if d)
            rest = rest.partition(" ")[2]
        found = _OPCODE.match(rest.lstrip())
        if found is not None:
            yield HloInstruction(computation, name, dtype, shape, found.group(1), line)


_COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "collective-broadcast",
)


def hlo_collectives(hlo_text: str, mesh) -> Counter:
    """Count the collectives of a compiled program by the mesh axes they communicate over.

    **Arguments:**

    - `hlo_text`: the compiled program's text, e.g.
      `jax.jit(f).lower(*args).compile().as_text()` (for an `eqx.filter_jit` function,
      `f.lower(*args).compile().compiled.as_text()`).
    - `mesh`: the mesh the program runs on (a `Mesh` or `AbstractMesh`).

    **Returns:** a `collections.Counter` keyed by `(op, axes)`, e.g.
    `("all-reduce", ("data",))` for a gradient all-reduce over the data axis, where
    `axes` are the mesh axes along which the devices of one group differ. Groups the
    parser cannot read count under `axes = ("?",)`.
    """
    names = tuple(mesh.axis_names)
    shape = tuple(mesh.shape[n] for n in names)
    counts = Counter()
    for instruction in hlo_instructions(hlo_text):
        op = instruction.opcode.removesuffix("-start")
        if op not in _COLLECTIVES:
            continue
        groups = _device_groups(instruction.line, int(np.prod(shape)))
        if groups is None:
            axes = ("?",)
        else:
            axes = _varying_axes(groups, names, shape)
        counts[(op, axes)] += 1
    return counts


def _device_groups(line: str, n_devices: int) -> list[list[int]] | None:
    """The groups of devices of one collective, from any of XLA's three spellings."""
    pairs = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", line)
    if pairs is not None:
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1))]
    listed = re.search(r"replica_groups=\{(\{[\d,{}]*\}|)\}", line)
    if listed is not None:
        groups = [[int(v) for v in g.split(",") if v] for g in re.findall(r"\{([\d,]*)\}", listed.group(1))]
        return groups if groups else [list(range(n_devices))]
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if iota is not None:
        n_groups, size = int(iota.group(1)), int(iota.group(2))
        return _iota(iota.group(3), iota.group(4)).reshape(n_groups, size).tolist()
    named = re.search(
        r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\((.*?)\))? \{([^}]*)\}", line
    )
    if named is not None:
        axes = re.findall(r"'(\w+)'=(\d+)", named.group(1))
        sizes = [int(s) for _, s in axes]
        ids = _device_ids(named.group(2), int(np.prod(sizes)))
        if ids is None:
            return None
        grid = ids.reshape(sizes)
        chosen = [i for i, (a, _) in enumerate(axes) if f"'{a}'" in named.group(3)]
        rest = [i for i in range(len(axes)) if i not in chosen]
        grid = np.transpose(grid, rest + chosen)
        return grid.reshape(-1, int(np.prod([sizes[i] for i in chosen]))).tolist()
    return None


def _iota(dims: str, perm: str | None) -> np.ndarray:
    shape = [int(d) for d in dims.split(",")]
    ids = np.arange(int(np.prod(shape))).reshape(shape)
    if perm:
        ids = np.transpose(ids, [int(p) for p in perm.split(",")])
    return ids.reshape(-1)


def _device_ids(spelled: str | None, n: int) -> np.ndarray | None:
    if spelled is None:
        return np.arange(n)
    iota = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", spelled.strip())
    if iota is not None:
        return _iota(iota.group(1), iota.group(2))
    if re.fullmatch(r"[\d,\s]+", spelled):
        return np.array([int(v) for v in spelled.split(",")])
    return None


def _varying_axes(groups, names, shape) -> tuple[str, ...]:
    """The mesh axes along which the devices of the groups differ (mesh order)."""
    varying = set()
    for group in groups:
        coords = np.array([np.unravel_index(d, shape) for d in group])
        varying |= {names[i] for i in range(len(names)) if len(set(coords[:, i])) > 1}
    return tuple(n for n in names if n in varying)
