"""What loading a checkpoint costs: peak memory against the file's size, time against
`safetensors.numpy.load_file`.

    python bench/load.py                     # SmolLM2-135M and Qwen2.5-0.5B shapes (~3 min on 2 cores)
    python bench/load.py --quick --out /tmp/x  # tiny shapes, 1 repeat (for the tests)
    python bench/load.py --save              # bench/results/load_cpu.json (committed)
    python bench/load.py --section long      # only section 4 (~30 s), into --out

Two checkpoints with random weights, written by `eqrope.to_hf` into a temporary directory
(removed afterwards): the SmolLM2-135M shape in bfloat16 (257 MiB) and the Qwen2.5-0.5B
shape (q/k/v biases) in float32 (1.9 GiB), with their published sizes. The SmolLM2 one is
also written by `eqrope.save`, for `eqrope.load`. Every measurement runs in a fresh
Python process (this file, run as `python bench/load.py child JOB`; `--quick` runs all of
a checkpoint's in one):

1. `memory`: the peak RSS growth of one load. The child imports JAX and eqrope, loads a
   tiny checkpoint of the same kind (JAX's own allocations), lowers its peak RSS to the
   current one (`/proc/self/clear_refs`, `peak_reset`), then loads the checkpoint:
   growth = `VmHWM` after - `VmRSS` before, as a ratio of the safetensors files' bytes.
   Cases: `from_hf` in both layouts, `load_file`, and (SmolLM2) `eqrope.load` in both.
2. `time`: `eqrope.from_hf` (dtype None, both layouts) against `load_file` of the same
   files, interleaved round by round (`_timing.time_calls`) after one untimed call of
   each: medians and min/max of the repeats. The ratio is of the medians.

3. `generate`: what a `generate` call costs beyond the model, the model as the loaders
   return it (`default`: the decoding layout, stacked for the bfloat16 SmolLM2 on the CPU,
   unstacked for the float32 Qwen) and stacked. The child loads the checkpoint, runs one
   `generate` call (it compiles), then `CALLS` more of the same, each with its peak RSS
   reset first: `growth_nbytes` = the largest `VmHWM` after a call - `VmRSS` before it,
   as a ratio of the weights' bytes. A stacked float32 model's blocks are sliced into a
   copy inside every call; the default layout is read in place (docs/kv_cache.md). The
   first call's wall time is recorded too (`first_call_s`, compile included).

4. `long`: the SmolLM2-135M shape in bfloat16 built for 131072 positions (its
   `max_position_embeddings`), loaded with `from_hf` and a first `generate` call of 16
   tokens after 8, in a fresh process (`bench/_memory.py`): the peak RSS from before the
   load to the end of that call (compile included), as a ratio of the weights' bytes.

Writes `load.json` to `--out` (default `bench/results/latest/`, ignored by git) or, with
`--save`, `bench/results/load_cpu.json`, with the machine (platform, CPUs, load averages
at start and end) and versions (python, jax, equinox, numpy, safetensors), and prints a
table. Targets are reported (target, measured, met), never asserted.
"""

import argparse
import importlib.metadata
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import equinox as eqx
import jax
import numpy as np
import safetensors.numpy

import eqrope
from _long_cache import _reset_peak
from _memory import _status_nbytes, peak_growth
from _roofline import weight_nbytes
from _report import fmt, target, timing_head, timing_row, verdict
from _timing import add_output_arguments, log, machine_info, results_folder, time_calls, without_result, write_json


# Published sizes: huggingface.co/HuggingFaceTB/SmolLM2-135M and Qwen/Qwen2.5-0.5B,
# config.json, as eqrope configs (max_len: max_position_embeddings).
SHAPES = {
    "smollm2_135m": dict(
        vocab_size=49152, d_model=576, n_heads=9, n_blocks=30, max_len=8192, d_ff=1536,
        n_kv_heads=3, rope_base=100000.0, norm_eps=1e-5, dtype="bfloat16",
    ),
    "qwen2.5_0.5b": dict(
        vocab_size=151936, d_model=896, n_heads=14, n_blocks=24, max_len=32768, d_ff=4864,
        n_kv_heads=2, rope_base=1000000.0, norm_eps=1e-6, dtype="float32",
        attention=eqrope.AttentionOptions(qkv_bias=True),
    ),
}  # fmt: skip
COMMON = dict(tie_embeddings=True, head_bias=False)
# --quick: the same heads, kv heads, options and dtype at head_dim 8, 2 blocks.
QUICK = dict(vocab_size=512, n_blocks=2, d_ff=64, max_len=64)
TINY = dict(vocab_size=64, n_blocks=1, d_ff=32, max_len=16)  # the children's warm-up
MODES = {"default": dict(repeats=3, quick=False), "quick": dict(repeats=1, quick=True)}
MEMORY_LIMIT, TIME_LIMIT, CALL_LIMIT, LONG_LIMIT = 1.3, 1.5, 0.1, 2.0
LONG_POSITIONS, LONG_PROMPT, LONG_NEW = 131072, 8, 16  # the long section's model and job
CALLS, PROMPT, NEW = 3, 8, 4  # the generate section: calls after the compiling one, tokens
METHOD = (
    "each figure from a fresh Python process. memory: a tiny checkpoint of the same kind "
    "loaded first, the peak RSS reset to the current RSS (/proc/self/clear_refs, peak_reset), "
    "growth_nbytes = VmHWM after one load - VmRSS before it, ratio = growth / the "
    "safetensors files' bytes. time: from_hf (dtype None, stacked and unstacked) and "
    "safetensors.numpy.load_file of the same files, one untimed call each, then the repeats "
    "interleaved round by round (nothing kept between calls); time_ratio = median from_hf / "
    "median load_file. generate: from_hf (the default layout, then stacked), one "
    "generate call (compiles), then CALLS calls, each after a peak reset: growth_nbytes = "
    "max(VmHWM after - VmRSS before), ratio = growth / the weights' bytes"
)
_LOADERS = {
    "from_hf": lambda path, layout: eqrope.from_hf(path, layout=layout),
    "load": lambda path, layout: eqrope.load(path, layout=layout),
    "load_file": lambda path, layout: _load_file(path),
}


def config_of(name: str, sizes: dict | None = None) -> dict:
    """The eqrope options of shape `name`, with `sizes` (QUICK, TINY) put in; the width
    follows the heads at head_dim 8 when sizes are put in."""
    fields = {**SHAPES[name], **COMMON}
    if sizes is not None:
        fields.update(sizes, d_model=8 * fields["n_heads"])
    return fields


def random_model(fields: dict, seed: int = 0) -> eqrope.RotaryDecoder:
    """A decoder with `fields` whose arrays are drawn with NumPy (float32 draws, cast):
    no initialiser runs, which for 0.5B parameters takes minutes on 2 cores."""
    skeleton = eqx.filter_eval_shape(lambda: eqrope.RotaryDecoder(**fields, key=jax.random.key(0)))
    rng = np.random.default_rng(seed)

    def draw(leaf):
        scale = 1.0 / math.sqrt(leaf.shape[-2]) if len(leaf.shape) > 1 else 1.0
        return jax.device_put((rng.standard_normal(leaf.shape, np.float32) * scale).astype(leaf.dtype))

    return jax.tree.map(draw, skeleton)


def _load_file(path: str) -> dict:
    files = sorted(pathlib.Path(path).glob("*.safetensors"))
    return {k: v for f in files for k, v in safetensors.numpy.load_file(str(f)).items()}


def file_nbytes(path: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


# -- the children (fresh processes) ---------------------------------------------------


def child_memory(kind: str, layout: str, path: str, tiny: str) -> dict:
    read = _LOADERS[kind]
    jax.block_until_ready(read(tiny, layout))  # JAX's client and first buffers
    reset = _reset_peak()
    before = _status_nbytes()
    start = time.perf_counter()
    result = jax.block_until_ready(read(path, layout))
    seconds = time.perf_counter() - start
    after = _status_nbytes()
    return {"rss_before_nbytes": before["VmRSS"], "peak_after_nbytes": after["VmHWM"],
            "rss_after_nbytes": after["VmRSS"], "growth_nbytes": after["VmHWM"] - before["VmRSS"],
            "peak_reset": reset, "seconds": seconds, "layout": getattr(result, "layout", None)}  # fmt: skip


def child_time(path: str, repeats: int) -> dict:
    def run(kind, layout="stacked"):
        def call():  # nothing kept from one call to the next
            jax.block_until_ready(_LOADERS[kind](path, layout))

        return call

    calls = {"from_hf": run("from_hf"), "from_hf_unstacked": run("from_hf", "unstacked"),
             "load_file": run("load_file")}  # fmt: skip
    return {k: without_result(v) for k, v in time_calls(calls, repeats=repeats, warmup=1).items()}


def child_generate(path: str, layout: str | None) -> dict:
    """The peak RSS growth of `generate` calls after the first (see the docstring, 3.),
    the model from `from_hf(path)` (`layout=None`: the default)."""
    model = eqrope.from_hf(path) if layout is None else eqrope.from_hf(path, layout=layout)
    prompt = np.arange(PROMPT, dtype=np.int32) % model.vocab_size
    start = time.perf_counter()
    first = jax.block_until_ready(eqrope.generate(model, prompt, NEW))
    first_call_s, calls = time.perf_counter() - start, []
    for _ in range(CALLS):
        time.sleep(0.2)  # the last call's scratch is freed after its results are ready
        reset = _reset_peak()
        before = _status_nbytes()
        tokens = jax.block_until_ready(eqrope.generate(model, prompt, NEW))
        after = _status_nbytes()
        assert np.array_equal(tokens, first), "a later generate call gave other tokens"
        calls.append({"rss_before_nbytes": before["VmRSS"], "peak_after_nbytes": after["VmHWM"],
                      "rss_after_nbytes": after["VmRSS"], "peak_reset": reset,
                      "growth_nbytes": after["VmHWM"] - before["VmRSS"]})  # fmt: skip
    weights = weight_nbytes(model)
    growth = max(c["growth_nbytes"] for c in calls)
    return {"layout": model.layout, "dtype": model.config.dtype, "weights_nbytes": weights, "first_call_s": first_call_s,
            "growth_nbytes": growth, "ratio": growth / weights, "calls": calls}  # fmt: skip


def child(job: dict) -> dict:
    """A child's work: `job["memory"]`, a list of `[kind, layout, path, tiny]` cases, one
    after the other; `job["time"]`, `[path, repeats]` or None; `job["generate"]`, a
    list of `[path, layout or None]`."""
    return {"memory": [child_memory(*case) for case in job["memory"]],
            "time": None if job["time"] is None else child_time(*job["time"]),
            "generate": [child_generate(*case) for case in job.get("generate", [])]}  # fmt: skip


def _spawn(memory: list, time_job=None, generate=()) -> dict:
    job = json.dumps({"memory": [[k, l, str(p), str(t)] for k, l, p, t in memory], "time": time_job,
                      "generate": [[str(p), layout] for p, layout in generate]})  # fmt: skip
    command = [sys.executable, str(pathlib.Path(__file__).resolve()), "child", job]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"bench/load.py child failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- the parent -------------------------------------------------------------------------


def measure(name: str, cfg: dict, root: pathlib.Path) -> dict:
    """Write shape `name`'s checkpoints under `root` and measure them (see the docstring)."""
    sizes = QUICK if cfg["quick"] else None
    fields = config_of(name, sizes)
    model = random_model(fields)
    hf, hf_tiny = root / name, root / f"{name}_tiny"
    eqrope.to_hf(model, hf)
    eqrope.to_hf(random_model(config_of(name, TINY)), hf_tiny)
    nbytes = file_nbytes(hf)
    cases = [("from_hf", "stacked", hf, hf_tiny), ("from_hf", "unstacked", hf, hf_tiny),
             ("load_file", "stacked", hf, hf_tiny)]  # fmt: skip
    if name == "smollm2_135m":
        ours, ours_tiny = eqrope.save(root / f"{name}_eqrope", model), root / f"{name}_eqrope_tiny"
        eqrope.save(ours_tiny, random_model(config_of(name, TINY)))
        cases += [("load", layout, ours, ours_tiny) for layout in ("stacked", "unstacked")]
    params = eqrope.count_params(model)
    del model
    keys = [kind if kind == "load_file" else f"{kind}_{layout}" for kind, layout, _, _ in cases]
    time_job = [str(hf), cfg["repeats"]]
    log(f"  {name}: memory of {', '.join(keys)}; time, {cfg['repeats']} repeats "
        f"(load {os.getloadavg()[0]:.1f})")
    layouts = {"default": None, "stacked": "stacked"}
    if cfg["quick"]:  # one process for everything: no figure to keep, only the code to run
        done = _spawn(cases, time_job, [(hf, layout) for layout in layouts.values()])
        records, timing, calls = done["memory"], done["time"], done["generate"]
    else:  # a fresh process for each load
        records = [_spawn([case])["memory"][0] for case in cases]
        timing = _spawn([], time_job)["time"]
        calls = [_spawn([], None, [(hf, layout)])["generate"][0] for layout in layouts.values()]
    memory = {}
    for key, (_, _, path, _), record in zip(keys, cases, records):
        record["ratio"] = record["growth_nbytes"] / file_nbytes(path)
        memory[key] = record
    return {
        "config": {k: str(v) if k == "attention" else v for k, v in fields.items()},
        "params": params, "file_nbytes": nbytes, "memory": memory, "time": timing,
        "generate": dict(zip(layouts, calls)),
        "time_ratio": timing["from_hf"]["median_s"] / timing["load_file"]["median_s"],
        "time_ratio_unstacked": timing["from_hf_unstacked"]["median_s"] / timing["load_file"]["median_s"],
        "loadavg_after": list(os.getloadavg()),
    }  # fmt: skip


def long_positions(cfg: dict, root: pathlib.Path) -> dict:
    """Section 4 (see the docstring): loading and a first short job of a model built for
    `LONG_POSITIONS` positions, in a fresh process."""
    fields = {**config_of("smollm2_135m", QUICK if cfg["quick"] else None), "max_len": LONG_POSITIONS}
    path = root / "smollm2_135m_long"
    eqrope.to_hf(random_model(fields), path)
    log(f"  smollm2_135m at max_len {LONG_POSITIONS}: load and {LONG_NEW} tokens (load {os.getloadavg()[0]:.1f})")
    return peak_growth(path, LONG_PROMPT, LONG_NEW)


def targets(result: dict) -> list[dict]:
    smol, qwen = result["checkpoints"]["smollm2_135m"], result["checkpoints"]["qwen2.5_0.5b"]
    out = [target(f"from_hf peak RSS growth / file bytes, SmolLM2-135M bf16, {layout}",
                  f"<= {MEMORY_LIMIT}", smol["memory"][f"from_hf_{layout}"]["ratio"],
                  smol["memory"][f"from_hf_{layout}"]["ratio"] <= MEMORY_LIMIT)
           for layout in ("stacked", "unstacked")]  # fmt: skip
    out.append(target("from_hf / load_file time (medians), Qwen2.5-0.5B f32", f"<= {TIME_LIMIT}",
                      qwen["time_ratio"], qwen["time_ratio"] <= TIME_LIMIT))
    out += [target(f"generate call's peak RSS growth / weights, {name}, default layout",
                   f"<= {CALL_LIMIT}", c["generate"]["default"]["ratio"],
                   c["generate"]["default"]["ratio"] <= CALL_LIMIT)
            for name, c in result["checkpoints"].items()]  # fmt: skip
    return out + long_targets(result)


def long_targets(result: dict) -> list[dict]:
    long = result["long"]["load_and_first_over_weights"]
    return [target(f"from_hf + first 16-token generate, peak RSS / weights, bf16 max_len {LONG_POSITIONS}",
                   f"<= {LONG_LIMIT}", long, long <= LONG_LIMIT)]


def table(result: dict) -> str:
    m = result["machine"]
    lines = [f"eqrope load benchmark ({result['mode']}), {m['cpu_model']}, {m['cpu_count']} CPUs, "
             f"jax {m['jax']}, safetensors {m['safetensors']}; load average "
             f"{result['loadavg']['start']} -> {result['loadavg']['end']}"]  # fmt: skip
    for name, c in result["checkpoints"].items():
        lines += ["", f"{name} ({c['config']['dtype']}, {c['params']:,} params, "
                  f"{c['file_nbytes'] / 2**20:.1f} MiB of safetensors)",
                  f"  {'peak RSS growth':<22}{'MiB':>9}{'x file':>8}"]  # fmt: skip
        lines += [f"  {k:<22}{r['growth_nbytes'] / 2**20:>9.1f}{r['ratio']:>8.2f}" for k, r in c["memory"].items()]
        lines += ["", timing_head(22)]
        lines += [timing_row(k, r, 22) for k, r in c["time"].items()]
        lines.append(f"  from_hf / load_file (medians): {c['time_ratio']:.2f} stacked, "
                     f"{c['time_ratio_unstacked']:.2f} unstacked")
        lines += ["", f"  {'later generate call, peak RSS':<32}{'MiB':>9}{'x weights':>10}{'first s':>9}"]
        lines += [f"  {k + ' (' + r['layout'] + ')':<32}{r['growth_nbytes'] / 2**20:>9.1f}{r['ratio']:>10.3f}"
                  f"{r['first_call_s']:>9.2f}" for k, r in c["generate"].items()]  # fmt: skip
    long = result["long"]
    lines += ["", f"bfloat16 SmolLM2-135M shape at max_len {long['max_len']}: from_hf and a first "
              f"{long['new_tokens']}-token generate peak at {long['load_and_first_over_weights']:.2f}x "
              f"the weights (load {long['load']['growth_nbytes'] / 2**20:.0f} MiB, first call "
              f"{long['first_call']['growth_nbytes'] / 2**20:.0f} MiB, weights {long['weights_nbytes'] / 2**20:.0f} MiB)"]
    lines += ["", "targets:"]
    lines += [f"  {x['name']:<62}{x['target']:>8}{fmt(x['measured']):>9}  {verdict(x['met'])}"
              for x in result["targets"]]  # fmt: skip
    lines.append(f"\nwall time {result['wall_s']:.0f} s")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes and 1 repeat, for the tests")
    parser.add_argument("--section", choices=("all", "long"), default="all",
                        help="long: only section 4 (the 131072-position load and first call)")
    add_output_arguments(parser, "folder for load.json")
    args = parser.parse_args(argv)
    if args.section != "all" and args.save:
        parser.error(f"--section {args.section} writes a partial result: use --out (or no flag), "
                     "or run every section (--section all) with --save")
    mode = "quick" if args.quick else "default"
    cfg = MODES[mode]
    path = (results_folder(True) / "load_cpu.json" if args.save
            else (args.out if args.out is not None else results_folder(False)) / "load.json")  # fmt: skip
    start = time.perf_counter()
    machine = {**machine_info(), "safetensors": importlib.metadata.version("safetensors")}
    result = {"mode": mode, "section": args.section, "machine": machine, "repeats": cfg["repeats"],
              "loadavg": {"start": list(os.getloadavg())}, "checkpoints": {}}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="eqrope_load_") as tmp:
        for name in SHAPES if args.section == "all" else ():
            log(f"[{mode}] {name} ({time.perf_counter() - start:.0f} s)")
            result["checkpoints"][name] = measure(name, cfg, pathlib.Path(tmp))
            for leftover in pathlib.Path(tmp).iterdir():  # free the disk before the next
                shutil.rmtree(leftover)
        log(f"[{mode}] long positions ({time.perf_counter() - start:.0f} s)")
        result["long"] = long_positions(cfg, pathlib.Path(tmp))
    result["loadavg"]["end"] = list(os.getloadavg())
    result["targets"] = targets(result) if args.section == "all" else long_targets(result)
    result["wall_s"] = time.perf_counter() - start
    result["method"] = METHOD
    written = write_json(path, result)
    print(table(result))
    print(f"wrote {written}")
    return result


if __name__ == "__main__":
    if sys.argv[1:2] == ["child"]:
        print(json.dumps(child(json.loads(sys.argv[2]))))
    else:
        main()
