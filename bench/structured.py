"""What structured output costs (issue 41): compiling a constraint (part 1) and a
constrained decode step (part 2), at the SmolLM2-135M shape (vocabulary 49,152 tokens).

    python bench/structured.py                      # 49,152 tokens, 5 repeats (10-20 minutes on 2 cores)
    python bench/structured.py --quick --out /tmp/x  # 2,048 tokens, a 2-block model, 1 repeat
    python bench/structured.py --save               # bench/results/structured_cpu.json (committed)

The vocabulary is synthetic and byte-level (seeded): the 256 single bytes, then tokens of
2-10 bytes drawn like text (lowercase words with or without a leading space, capitalised
words, digit runs, JSON punctuation such as `{"` and `",`, and pieces of UTF-8 characters).
No real tokenizer is downloaded; a real one's length and character mix will shift the
numbers.

Constraints: a flat record (4 properties), a nested record (an object in an object, an
array of enums, an optional property), an enum of 8 strings, and an ISO date regex. For
each: the compile time (outlines-core's index and the export; the compile cache is
cleared before each repeat; the vocabulary's outlines-core form is built once, timed
apart as `vocabulary_s`), the states, exceptions, the table's bytes, and what a dense
`int32 (states, vocab)` next-state table would take. Medians, min and max of the repeats.

Part 2 (`_constrained_step.py`): the model has the published SmolLM2-135M shape
(`_shapes.SMOLLM2_135M`, random weights, float32; `--quick`: 2 blocks of width 72, the
2,048-token vocabulary); batch 8, each row under its own constraint (7 of `TWENTY`, and a
free-text regex that never ends), against the same call without constraints: a decode
step's cost, the mask's cost alone, and the XLA compiles of 20 constraints run through
the compiled program (target: a constrained step <= 1.15x an unconstrained one, 0
compiles).

Writes `structured.json` to `--out` (default `bench/results/latest/`, ignored by git) or,
with `--save`, `bench/results/structured_cpu.json`, with the machine, versions and load
average (other processes share the machine's cores), and prints a table.
"""

import argparse
import importlib.metadata
import os
import random
import statistics
import time

import eqrope
from eqrope.structured import _compile
import _constrained_step
from _shapes import SMOLLM2_135M, eqrope_config
from _timing import add_output_arguments, log, machine_info, results_folder, write_json


FLAT = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "email_ok": {"type": "boolean"},
        "score": {"type": "number"},
    },
    "required": ["name", "age", "email_ok", "score"],
    "additionalProperties": False,
}
NESTED = {
    "type": "object",
    "properties": {
        "user": {
            "type": "object",
            "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 16}},
            "required": ["id", "name"],
            "additionalProperties": False,
        },
        "items": {"type": "array", "items": {"enum": ["book", "pen", "lamp"]}, "maxItems": 4},
        "status": {"enum": ["open", "closed"]},
        "note": {"type": "string", "maxLength": 10},
    },
    "required": ["user", "items", "status"],
    "additionalProperties": False,
}
SPECS = {
    "flat_record": eqrope.JsonSchema(FLAT),
    "nested_record": eqrope.JsonSchema(NESTED),
    "enum": eqrope.JsonSchema({"enum": ["red", "green", "blue", "cyan", "magenta", "yellow", "black", "white"]}),
    "iso_date_regex": eqrope.Regex(r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"),
}
# Part 2's 20 different constraints: part 1's, and records, enums, arrays and regexes.
_RECORD = {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"], "additionalProperties": False}
TWENTY = [
    *SPECS.values(),
    *(eqrope.JsonSchema({**_RECORD, "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": n}}})
      for n in (4, 8, 12)),
    *(eqrope.JsonSchema({"enum": [f"label{i}" for i in range(n)]}) for n in (2, 3, 5, 7)),
    *(eqrope.JsonSchema({"type": "array", "items": {"type": "integer"}, "maxItems": n}) for n in (2, 3)),
    eqrope.JsonSchema({"type": "boolean"}),
    eqrope.JsonSchema(FLAT, whitespace="flexible"),
    *(eqrope.Regex(f"[0-9]{{{n}}}-[A-Z]{{2}}") for n in (1, 2, 3)),
    eqrope.Choice(["yes", "no", "maybe"]),
    eqrope.Choice(["positive", "negative", "neutral"]),
]  # fmt: skip
STEP = {"default": dict(batch=8, prompt_len=16, short=8, long=72),
        "quick": dict(batch=8, prompt_len=4, short=2, long=6)}  # fmt: skip


class SyntheticVocabulary:
    """A byte-level vocabulary of `size` tokens (seeded): all that `compile` reads of a
    tokenizer is `token_bytes()`."""

    def __init__(self, size: int, seed: int = 0):
        rng = random.Random(seed)
        lower, upper = "abcdefghijklmnopqrstuvwxyz", "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
        punct = ['{"', '",', '":', '"}', "],", "[{", "}]", ", ", ". ", "\n", "  ", '": "', '"]']
        seen = {bytes([b]) for b in range(256)}
        tokens = [bytes([b]) for b in range(256)]
        while len(tokens) < size:
            kind = rng.random()
            if kind < 0.55:
                word = "".join(rng.choice(lower) for _ in range(rng.randint(2, 9)))
                text = (" " if rng.random() < 0.5 else "") + word
            elif kind < 0.7:
                text = rng.choice(upper) + "".join(rng.choice(lower) for _ in range(rng.randint(1, 8)))
            elif kind < 0.8:
                text = "".join(rng.choice("0123456789") for _ in range(rng.randint(2, 4)))
            elif kind < 0.9:
                text = rng.choice(punct) + (rng.choice(lower) * rng.randint(0, 1))
            else:
                text = "".join(chr(rng.randint(0xA0, 0x2FFF)) for _ in range(rng.randint(1, 3)))
            b = text.encode()[: rng.randint(2, 10)] if kind >= 0.9 else text.encode()
            if len(b) >= 2 and b not in seen:
                seen.add(b)
                tokens.append(b)
        self._tokens = tokens

    def token_bytes(self) -> list[bytes]:
        return list(self._tokens)


def measure(spec, vocabulary: SyntheticVocabulary, repeats: int) -> dict:
    times, automaton = [], None
    for _ in range(repeats):
        _compile._cache.clear()
        start = time.perf_counter()
        automaton = spec.compile(vocabulary)
        times.append(time.perf_counter() - start)
    states, exceptions = automaton.accepting.size, automaton.exc_token.size
    table = sum(a.nbytes for a in automaton[:-1])
    return {
        "median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "times_s": times,
        "states": states, "exceptions": exceptions, "table_nbytes": table,
        "allowed_nbytes": automaton.allowed.nbytes, "dense_int32_nbytes": 4 * states * automaton.vocab,
    }  # fmt: skip


def step_model(size: int, quick: bool, max_len: int) -> eqrope.RotaryDecoder:
    """The SmolLM2-135M shape with a `size`-token vocabulary (`quick`: 2 blocks of width
    72), random float32 weights drawn with NumPy (`load.random_model`)."""
    from load import random_model

    fields = dict(eqrope_config(SMOLLM2_135M, max_len=max_len), vocab_size=size)
    if quick:
        fields.update(d_model=72, n_blocks=2, d_ff=32)
    return random_model(fields)


def print_step(r: dict) -> None:
    print(f"decode step, batch {r['batch']} ({r['long']} - {r['short']} new tokens, capacity {r['capacity']}):")
    for name, step in r["steps"].items():
        ms = {k: 1e3 * v for k, v in step["per_step_s"].items()}
        paired = step["paired_ratios"]
        print(f"  {name:<8} unconstrained {ms['plain']:.2f} ms, constrained {ms['constrained']:.2f} ms: "
              f"{step['ratio']:.3f}x (target <= {r['target_ratio']}x: {'met' if step['met'] else 'missed'}); "
              f"minima {step['ratio_of_minima']:.3f}x, rounds {min(paired):.3f}-{max(paired):.3f}x "
              f"(median {step['paired_ratio_median']:.3f}x)")  # fmt: skip
    m = r["mask_alone"]
    print(f"  the mask alone: {1e3 * m['per_step_s']:.3f} ms a step ({100 * m['fraction_of_greedy_step']:.1f}% of "
          f"a greedy unconstrained step)")  # fmt: skip
    t = r["twenty"]
    print(f"  {t['constraints']} constraints in {t['calls']} calls: {t['new_compiles']} new XLA compiles")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2,048 tokens, a 2-block model, 1 repeat")
    parser.add_argument("--vocab", type=int, default=None, help="vocabulary size (default 49,152)")
    parser.add_argument("--repeats", type=int, default=None, help="timed compiles per constraint, and timed calls per decode variant (default 5)")
    add_output_arguments(parser, "folder for structured.json")
    args = parser.parse_args()
    size = args.vocab or (2048 if args.quick else 49152)
    repeats = args.repeats or (1 if args.quick else 5)
    path = (results_folder(True) / "structured_cpu.json" if args.save
            else (args.out if args.out is not None else results_folder(False)) / "structured.json")  # fmt: skip
    log(f"synthetic vocabulary of {size} tokens")
    vocabulary = SyntheticVocabulary(size)
    _compile._vocabulary.cache_clear()
    start = time.perf_counter()
    _compile._vocabulary(_compile._vocabulary_key(vocabulary.token_bytes()), tuple(vocabulary.token_bytes()))
    vocabulary_s = time.perf_counter() - start
    results = {}
    for name, spec in SPECS.items():
        log(f"{name} ...")
        results[name] = measure(spec, vocabulary, repeats)
    step = STEP["quick" if args.quick else "default"]
    model = step_model(size, args.quick, step["prompt_len"] + step["long"])
    decode = _constrained_step.measure(model, vocabulary, TWENTY, repeats=repeats, **step)
    machine = {**machine_info(), "outlines_core": importlib.metadata.version("outlines_core"),
               "load_average": os.getloadavg(),
               "note": "2 shared cores: other processes ran beside this one (load_average at the end)"}  # fmt: skip
    result = {"machine": machine, "vocab": size, "repeats": repeats, "vocabulary_s": vocabulary_s,
              "constraints": results, "decode_step": decode}  # fmt: skip
    written = write_json(path, result)
    print(f"vocabulary {size} tokens (outlines-core form built once: {vocabulary_s:.2f} s)")
    print(f"  {'':<16}{'median s':>10}{'min-max s':>16}{'states':>8}{'exceptions':>12}{'table MiB':>11}{'dense MiB':>11}")
    for name, r in results.items():
        print(f"  {name:<16}{r['median_s']:>10.3f}{r['min_s']:>8.3f}-{r['max_s']:<7.3f}{r['states']:>8}"
              f"{r['exceptions']:>12}{r['table_nbytes'] / 2**20:>11.2f}{r['dense_int32_nbytes'] / 2**20:>11.1f}")  # fmt: skip
    print_step(decode)
    print(f"wrote {written}")


if __name__ == "__main__":
    main()
