"""What an XLA:CPU program holds, from the optimised HLO that XLA writes out.

`program_sizes(dump_dir)` reads the `*after_optimizations.txt` files that
`--xla_dump_to=DIR --xla_dump_hlo_as_text` leaves (one per compiled module) and counts,
for the largest module (the job's program; the others are JAX's small helpers):

- `instructions`: every HLO instruction, in every computation, fused ones included;
- `fusions`: fusion instructions (each is one kernel that XLA:CPU code-generates);
- `thunks`: what the runtime executes one by one, each compiled on its own: the
  instructions of the computations that are not the body of a fusion or a reduction's
  `to_apply` (those are inlined into their kernel), except parameters, tuples,
  get-tuple-element, constants and bitcasts, which generate no code.

XLA:CPU's compile time grows with the kernels it generates, so `thunks` and `fusions` say
where a compile goes whatever the machine's load.
"""

import pathlib
import re

FREE = frozenset(("parameter", "get-tuple-element", "tuple", "constant", "bitcast"))
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%?\S+ = ")
_OPCODE = re.compile(r"= (?:\([^=]*?\)|\S+) ([\w\-]+)\(")


def count(text: str) -> dict:
    """`instructions`, `fusions` and `thunks` of one module's HLO text (module docstring)."""
    computations, current = {}, None
    for line in text.splitlines():
        header = re.match(r"^(?:ENTRY )?%?(\S+) .*\{\s*$", line)
        if header:
            current = computations.setdefault(header.group(1), [])
        elif line.startswith("}"):
            current = None
        elif current is not None and _INSTRUCTION.match(line):
            opcode = _OPCODE.search(line)
            current.append((opcode.group(1) if opcode else "?", line))
    inlined = set()
    for body in computations.values():
        for opcode, line in body:
            for called in re.finditer(r"(?:calls|to_apply|comparator)=%?([\w.\-]+)", line):
                if opcode == "fusion" or called.group(0).startswith(("to_apply", "comparator")):
                    inlined.add(called.group(1))
    every = [op for body in computations.values() for op, _ in body]
    thunks = [op for name, body in computations.items() if name not in inlined for op, _ in body if op not in FREE]
    return {"instructions": len(every), "fusions": every.count("fusion"), "thunks": len(thunks)}


def program_sizes(dump_dir: pathlib.Path) -> dict:
    """`count` of the largest optimised module in `dump_dir`, with its module name."""
    files = sorted(pathlib.Path(dump_dir).glob("*after_optimizations.txt"), key=lambda p: p.stat().st_size)
    if not files:
        raise FileNotFoundError(f"no *after_optimizations.txt in {dump_dir}: was XLA_FLAGS passed?")
    text = files[-1].read_text()
    name = re.search(r"HloModule (\S+?),", text)
    return {"module": name.group(1) if name else files[-1].name, **count(text)}
