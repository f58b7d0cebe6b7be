"""First calls against the floor's, in fresh processes, and the time to the first token.

    python bench/first_call.py           # the seed protocol and both real shapes (~10 min)
    python bench/first_call.py --tiny --out /tmp/x   # tiny shapes, for the tests
    python bench/first_call.py --save    # update bench/results/first_call_cpu.json

Each first call runs in a new process (`_fresh.py`), alternating eqrope and the floor
(bench/_floor.py's unrolled decoder on the same arrays), so that both sides meet the same
machine. Rows:

- the seed protocol (model (65, 64, 4, 2, 256), prompt 0..7, 100 new tokens): eqrope cold
  (no persistent cache), the floor cold, and eqrope with JAX's persistent compilation
  cache warm (`eqrope.use_compilation_cache`, filled by a first process);
- the SmolLM2-135M shape (30 blocks, 64 new tokens after 32) and the Qwen2.5-0.5B shape
  (24 blocks, 32 after 32), float32, random weights: eqrope cold against the floor cold;
- the time to the first token at the SmolLM2 shape, a 32-token prompt: `generate` with
  `max_new=1` against the floor's one-pass prefill, both compiled, medians of repeats.

Every figure is a median with its min and max over the repeats; the CPU seconds of each
first call are beside its wall time (they move less when the machine is shared), and its
compile split into JAX's stages (`stages`: tracing, lowering, XLA; medians). `program`
gives each side's compiled program by what it holds (`_hlo.py`: HLO instructions, fusions
and the thunks XLA:CPU generates code for), from one more fresh process per side that
has XLA write its optimised HLO out; counts do not move with the machine's load.
"""

import argparse
import os
import pathlib
import statistics
import tempfile
import time

import eqrope
from _fresh import fresh_first_call
from _hlo import program_sizes
from _protocols import SEED_MODEL
from _shapes import QWEN25_05B, SMOLLM2_135M, eqrope_config
from _timing import add_output_arguments, log, machine_info, results_folder, write_json


def summary(records: list[dict], key: str = "first_s") -> dict:
    values = [r[key] for r in records]
    return {"median_s": statistics.median(values), "min_s": min(values), "max_s": max(values)}


def first_calls(config: dict, prompt: int, new: int, repeats: int, warm: bool) -> dict:
    """Cold first calls of eqrope and the floor (alternating), and warm-cache ones of
    eqrope when `warm`; each `repeats` times."""
    runs = {"eqrope_cold": [], "floor_cold": [], "eqrope_warm": []}
    job = dict(config=config, prompt=prompt, new=new)
    folder = tempfile.mkdtemp(prefix="eqrope_jax_cache_") if warm else None
    if warm:  # fill the persistent cache once
        fresh_first_call({**job, "who": "eqrope", "cache_dir": folder})
    for _ in range(repeats):
        runs["eqrope_cold"].append(fresh_first_call({**job, "who": "eqrope"}))
        runs["floor_cold"].append(fresh_first_call({**job, "who": "floor"}))
        if warm:
            runs["eqrope_warm"].append(fresh_first_call({**job, "who": "eqrope", "cache_dir": folder}))
    out = {}
    for name, records in runs.items():
        if records:
            stages = {k: statistics.median(r[k] for r in records) for k in ("trace_s", "lower_s", "compile_s")}
            out[name] = {**summary(records), "cpu": summary(records, "first_cpu_s"), "stages": stages,
                         "cache_hits": records[-1]["cache_hits"],
                         "cache_misses": records[-1]["cache_misses"]}
    out["ratio_cold"] = out["eqrope_cold"]["median_s"] / out["floor_cold"]["median_s"]
    out["ratio_cold_cpu"] = out["eqrope_cold"]["cpu"]["median_s"] / out["floor_cold"]["cpu"]["median_s"]
    tokens = {name: records[-1]["tokens"] for name, records in runs.items() if records}
    out["tokens_equal"] = all(t == tokens["floor_cold"] for t in tokens.values())
    out["program"] = {who: program_of({**job, "who": who}) for who in ("eqrope", "floor")}
    out["program"]["thunk_ratio"] = out["program"]["eqrope"]["thunks"] / out["program"]["floor"]["thunks"]
    return out


def program_of(job: dict) -> dict:
    """What the job's compiled program holds (`_hlo.program_sizes`), from a fresh process
    that writes its optimised HLO out (not timed)."""
    with tempfile.TemporaryDirectory(prefix="eqrope_hlo_") as folder:
        fresh_first_call({**job, "dump_dir": folder})
        return program_sizes(pathlib.Path(folder))


def first_token(config: dict, prompt: int, repeats: int) -> dict:
    """The time to the first token, compiled, eqrope against the floor's prefill."""
    job = dict(config=config, prompt=prompt, new=64, prefill_only=True, repeats=repeats)
    e, f = fresh_first_call({**job, "who": "eqrope"}), fresh_first_call({**job, "who": "floor"})
    keep = ("median_s", "min_s", "max_s")
    return {"eqrope": {k: e[k] for k in keep}, "floor_prefill": {k: f[k] for k in keep},
            "ratio": e["median_s"] / f["median_s"], "prompt": prompt}


MODES = {
    "quick": dict(seed_repeats=3, real_repeats=1, ttft_repeats=5, real=True),
    "full": dict(seed_repeats=5, real_repeats=3, ttft_repeats=10, real=True),
    # The tests' run: the seed rows (the main job's too) and a small shape's first call.
    "tiny": dict(seed_repeats=1, real_repeats=1, ttft_repeats=0, real=False),
}


def seed_first_calls(repeats: int) -> dict:
    """The seed protocol's first calls in fresh processes: cold, the floor, warm cache."""
    return first_calls(SEED_MODEL.to_dict(), 8, 100, repeats, warm=True)


def targets(result: dict) -> list[dict]:
    rows = []
    if "seed" in result:
        seed = result["seed"]
        rows += [
            ("seed: first call, cold, fresh process, s", "<= 1.0", seed["eqrope_cold"]["median_s"], 1.0),
            ("seed: first call, warm persistent cache, s", "<= 0.6", seed["eqrope_warm"]["median_s"], 0.6),
        ]
    for name in ("smollm2_135m", "qwen25_05b"):
        if name in result:
            rows.append((f"{name}: first call / floor's, cold", "<= 1.25", result[name]["ratio_cold"], 1.25))
    if "first_token" in result:
        rows.append(("smollm2_135m: first token / floor's prefill", "<= 1.0", result["first_token"]["ratio"], 1.0))
    return [{"target": t, "goal": g, "measured": m, "met": m <= bound} for t, g, m, bound in rows]


def readme_table(result: dict) -> str:
    """The README's table of a run: each first call beside the floor's, with the compile's
    stages and each program's thunks (`_hlo.py`), then the targets."""
    rows = ["| case | eqrope | floor | ratio | trace + lower + XLA, eqrope (floor) | thunks, eqrope (floor) |",
            "|---|---:|---:|---:|---|---:|"]
    names = {"seed": "seed protocol, cold", "smollm2_135m": "SmolLM2-135M shape, cold",
             "qwen25_05b": "Qwen2.5-0.5B shape, cold"}
    for key, label in names.items():
        if key not in result:
            continue
        r = result[key]
        e, f = r["eqrope_cold"], r["floor_cold"]
        stages = lambda side: "{trace_s:.2f} + {lower_s:.2f} + {compile_s:.2f} s".format(**side["stages"])  # noqa: E731
        rows.append(
            f"| {label} | {e['median_s']:.2f} s | {f['median_s']:.2f} s | {r['ratio_cold']:.2f}× | "
            f"{stages(e)} ({stages(f)}) | {r['program']['eqrope']['thunks']} ({r['program']['floor']['thunks']}) |"
        )
    if "seed" in result:
        rows.append(f"| seed protocol, warm persistent cache | {result['seed']['eqrope_warm']['median_s']:.2f} s | | | | |")
    if "first_token" in result:
        t = result["first_token"]
        rows.append(f"| first token, SmolLM2-135M shape, compiled | {t['eqrope']['median_s'] * 1e3:.1f} ms | "
                    f"{t['floor_prefill']['median_s'] * 1e3:.1f} ms | {t['ratio']:.2f}× | | |")
    rows += ["", "| target | goal | measured | |", "|---|---|---:|---|"]
    rows += [f"| {t['target']} | {t['goal']} | {t['measured']:.2f} | {'met' if t['met'] else 'open'} |"
             for t in result["targets"]]
    return "\n".join(rows)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    size = parser.add_mutually_exclusive_group()
    for mode in MODES:
        size.add_argument(f"--{mode}", action="store_const", dest="mode", const=mode)
    add_output_arguments(parser, "folder for first_call.json")
    args = parser.parse_args(argv)
    mode = args.mode or "quick"
    cfg = MODES[mode]
    start = time.perf_counter()
    result = {"mode": mode, "machine": machine_info(), "loadavg": {"start": os.getloadavg()}}
    if cfg["seed_repeats"]:
        log(f"[{mode}] seed protocol, fresh processes")
        result["seed"] = seed_first_calls(cfg["seed_repeats"])
    if cfg["real"]:
        shapes = {"smollm2_135m": (SMOLLM2_135M, 64), "qwen25_05b": (QWEN25_05B, 32)}
    else:  # the tests' run: two small blocks of the SmolLM2 layout (grouped queries, tied)
        tiny = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                    num_key_value_heads=2)
        shapes = {"smollm2_135m": ({**SMOLLM2_135M, **tiny}, 8)}
    for name, (fields, new) in shapes.items():
        log(f"[{mode}] {name}, fresh processes")
        config = eqrope_config(fields, n_blocks=None if cfg["real"] else 2)
        result[name] = first_calls(config, 32, new, cfg["real_repeats"], warm=False)
    if cfg["ttft_repeats"]:
        log(f"[{mode}] time to the first token")
        config = eqrope_config(shapes["smollm2_135m"][0], n_blocks=None if cfg["real"] else 2)
        result["first_token"] = first_token(config, 32, cfg["ttft_repeats"])
    result["targets"] = targets(result)
    result["wall_s"] = time.perf_counter() - start
    result["loadavg"]["end"] = os.getloadavg()
    result["method"] = __doc__
    out = args.out if args.out is not None else results_folder(args.save)
    out.mkdir(parents=True, exist_ok=True)
    path = write_json(out / ("first_call_cpu.json" if args.save else "first_call.json"), result)
    print(readme_table(result))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
