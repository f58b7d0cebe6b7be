"""eqrope beside Hugging Face transformers: the same random weights, greedy generation.

    python bench/vs_transformers.py            # --quick, the default (~30 min on 2 cores, mostly `real`)
    python bench/vs_transformers.py --full     # 5 repeats everywhere
    python bench/vs_transformers.py --tiny --out /tmp/x   # tiny sizes, 1 repeat (smoke run)
    python bench/vs_transformers.py --tiny --only real --out /tmp/x   # the real-shape code, shrunk
    python bench/vs_transformers.py --profile  # also: where a decode step's time goes
    python bench/vs_transformers.py --torch-threads 1 --out /tmp/t1   # torch on one thread
    python bench/vs_transformers.py --only seed --out /tmp/seed         # one case
    python bench/vs_transformers.py --save     # update the committed bench/results/

Needs the optional `[hf]` extra (torch and transformers). One process, one machine: torch
runs with `torch.set_num_threads(os.cpu_count())` intra-op threads, and XLA's CPU client
uses every core by default. Both sides always hold the same weights: each eqrope model of
the seed and chapter cases (random weights, zero head bias as initialised) is exported
with `eqrope.to_hf_llama` and loaded with `transformers.LlamaForCausalLM.from_pretrained`;
each real-shape model is built by transformers and read with `eqrope.from_hf`.

Contenders, all greedy:

- `eqrope`: `eqrope.generate` with default arguments (the cached path: one compiled
  program, prefill then a loop of decode steps that stops after the last token; the
  cache has the smallest power of two of rows holding prompt and N, so the program
  compiles once per such length and batch, and `max_new` is traced);
- `hf_default`: `model.generate(ids, max_new_tokens=N, do_sample=False)` (dynamic cache);
- `hf_static`: the same with `cache_implementation="static"` (on CPU transformers does not
  auto-compile, so this is eager PyTorch with a preallocated cache); left out of the real
  shapes, where it costs minutes and has never been transformers' faster variant here;
- `hf_default_1thread`: `hf_default` with `torch.set_num_threads(1)` for the call: on a
  machine shared with other work, torch's OpenMP threads wait on each other and its
  multi-threaded times grow many-fold; one thread shows by how much.

Every target compares eqrope with transformers' better of `hf_default` and
`hf_default_1thread`, both measured in the same run (`hf_best`, `speedup_vs_hf_best`).
Each row times its contenders in rounds (`_timing.time_calls`): one warm-up call each,
reported apart as `first_s` (eqrope's with its compile seconds, `first_compile`), then
`repeats` rounds of one call each (median, min, max), so that load from other processes
falls on all of them alike.

Cases:

- `seed`: the seed's protocol (model (65, 64, 4, 2, 256), prompt of 8, 100 new tokens,
  batch 1); target eqrope >= 20x transformers.
- `chapter`: the textbook chapter's timing shape (vocab 256, width 256, 4 heads, 4
  blocks, d_ff 1024, max_len 1024, prompt of 4, N = 64, 128, 256, 512, batch 1);
  target >= 4x at N=512.
- `real` (`bench/_real_shapes.py`): the public shapes of SmolLM2-135M (Llama) and
  Qwen2.5-0.5B (Qwen2, q/k/v biases drawn non-zero), sizes copied from their published
  `config.json`, random float32 weights built with transformers' own config and model
  classes, `save_pretrained` into a temporary directory and read with `eqrope.from_hf`.
  A 32-token prompt and 128 new tokens, at batch 1 and at batch 8 (8 different random
  prompts, no padding). Targets: eqrope >= 2x transformers at batch 1 and >= 3x at batch
  8; at batch 1, eqrope's time per token against the DRAM roofline (weight bytes over a
  256 MiB numpy copy's rate, measured just before; `bench/_roofline.py`),
  roofline / measured >= 0.7 (the same against an all-core XLA pass, `bench/_bounds.py`,
  is reported beside it). Then the memory check (`bench/_memory.py`): a bfloat16
  checkpoint of the SmolLM2-135M shape with `max_position_embeddings` 131072, loaded
  with `eqrope.from_hf` (it stays bfloat16) in a fresh process, generating 16 tokens
  after 8: the peak RSS growth of that call (its compile included; the baseline after
  the model is loaded) <= 3x the weight bytes.

`--tiny` runs `seed` and `chapter` at tiny sizes; `--tiny --only real` runs the real-shape
code with the same heads at head_dim 8, 2 layers and a vocabulary of 256 (8 new tokens
after 8, batches 1 and 2), which is what tests/test_bench_real_shapes.py runs.

Writes `vs_transformers_cpu.json` to `--out` (default `bench/results/latest/`, ignored
by git; `--save` writes to the committed `bench/results/`): the machine, the versions,
every timing, and the targets as (target, goal, measured, met); and prints a table.
Targets are reported, never asserted. Timings are noisy when other work shares the CPU.
"""

import argparse
import importlib.metadata
import os
import pathlib
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import eqrope
from _timing import (add_output_arguments, log, machine_info, results_folder, time_calls,
                     without_result, write_json)


try:
    import torch
    import transformers
except ImportError:
    sys.exit(
        "bench/vs_transformers.py needs the [hf] extra:\n"
        "  pip install torch==2.13.0\n"
        "  pip install -c constraints-hf.txt -e '.[hf]'"
    )

import _real_shapes  # imports torch: after the check above
from _memory import memory_targets
from _bounds import COPY_CONVENTION, copy_probe
from _hf_profile import profile_step
from _report import print_vs_transformers


SEED_MODEL = dict(vocab_size=65, d_model=64, n_heads=4, n_blocks=2, max_len=256)
CHAPTER_MODEL = dict(vocab_size=256, d_model=256, n_heads=4, n_blocks=4, max_len=1024, d_ff=1024)
TINY_MODEL = dict(vocab_size=64, d_model=32, n_heads=2, n_blocks=2, max_len=64, d_ff=64)
# The reference numbers: transformers 5.24, torch 2.13, CPU, this kind of machine.
REFERENCE_HF_DEFAULT_S = {"seed": 0.089, "chapter_N512": 1.75}

# The real shapes' protocol (issue 13, item 7), and its copy-rate and memory settings.
REAL = dict(real_prompt=32, real_new=128, real_batches=(1, 8), real_tiny=False,
            copy_mb=256, copy_repeats=5, copy_call_bytes=2**30, memory_prompt=8, memory_new=16)
MODES = {
    "quick": dict(seed=SEED_MODEL, seed_prompt=8, seed_new=100, seed_repeats=5,
                  chapter=CHAPTER_MODEL, chapter_prompt=4, chapter_n=(64, 128, 256, 512),
                  chapter_repeats=3, **REAL, real_repeats=3, cases=("seed", "chapter", "real")),
    "full": dict(seed=SEED_MODEL, seed_prompt=8, seed_new=100, seed_repeats=5,
                 chapter=CHAPTER_MODEL, chapter_prompt=4, chapter_n=(64, 128, 256, 512),
                 chapter_repeats=5, **REAL, real_repeats=5, cases=("seed", "chapter", "real")),
    "tiny": dict(seed=TINY_MODEL, seed_prompt=4, seed_new=8, seed_repeats=1,
                 chapter=TINY_MODEL, chapter_prompt=4, chapter_n=(8,), chapter_repeats=1,
                 real_prompt=8, real_new=8, real_batches=(1, 2), real_tiny=True, real_repeats=1,
                 copy_mb=8, copy_repeats=1, copy_call_bytes=2**24, memory_prompt=8, memory_new=16,
                 cases=("seed", "chapter")),  # `--only real` runs the real shapes shrunk
}
CONTENDERS = ("eqrope", "hf_default", "hf_static", "hf_default_1thread")
REAL_CONTENDERS = ("eqrope", "hf_default", "hf_default_1thread")
# The targets compare with the faster of these two: transformers' default generate on all
# torch threads and on one thread.
BEST_OF = ("hf_default", "hf_default_1thread")


def build_pair(sizes: dict, directory: pathlib.Path):
    """An eqrope model (key 0) and the transformers model holding the same weights."""
    model = eqrope.RotaryDecoder(**sizes, key=jax.random.PRNGKey(0))
    eqrope.to_hf_llama(model, directory)  # the initial head bias is zeros: dropped exactly
    hf_model = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return model, hf_model


def runners(model, hf_model, prompt: np.ndarray, n: int, contenders=CONTENDERS) -> dict:
    """For each contender, a no-argument call that returns the generated ids as numpy.
    `prompt`: `(seq,)` or `(batch, seq)`; the ids come back with the same number of axes."""
    ids = torch.tensor(np.atleast_2d(prompt), dtype=torch.long)
    mask = torch.ones_like(ids)
    jprompt = jnp.asarray(prompt, jnp.int32)

    def ours():
        return np.asarray(eqrope.generate(model, jprompt, n))

    def theirs(threads=None, **extra):
        def run():
            saved = torch.get_num_threads()
            if threads is not None:
                torch.set_num_threads(threads)
            try:
                with torch.inference_mode():
                    out = hf_model.generate(
                        ids, attention_mask=mask, max_new_tokens=n, do_sample=False, **extra,
                    )
            finally:
                torch.set_num_threads(saved)
            return out[0].numpy() if prompt.ndim == 1 else out.numpy()

        return run

    every = {
        "eqrope": ours,
        "hf_default": theirs(),
        "hf_static": theirs(cache_implementation="static"),
        "hf_default_1thread": theirs(threads=1),
    }
    return {name: every[name] for name in contenders}


def first_difference(ours: np.ndarray, theirs: np.ndarray):
    """None where the ids are equal, else `[row, position]` of the first difference (row 0
    for a single prompt), or a note when the shapes differ."""
    if ours.shape != theirs.shape:
        return f"shapes differ: {list(ours.shape)} against {list(theirs.shape)}"
    where = np.argwhere(np.atleast_2d(ours) != np.atleast_2d(theirs))
    return None if where.size == 0 else [int(i) for i in where[0]]


def measure(model, hf_model, prompt: np.ndarray, n: int, repeats: int, contenders=CONTENDERS,
            also=None) -> dict:
    """Time the contenders in rounds (one warm-up call each, timed as the first call, then
    `repeats` rounds), with the calls of `also` (`{name: (call, record)}`, such as a copy
    probe) in the same rounds; `record(timing)` gives each of those its entry."""
    also = also or {}
    row = {
        "new_tokens": n,
        "prompt_len": int(prompt.shape[-1]),
        "batch": 1 if prompt.ndim == 1 else int(prompt.shape[0]),
        "contenders": list(contenders),
        "loadavg_1min_before": os.getloadavg()[0],
    }
    fns = runners(model, hf_model, prompt, n, contenders)
    # Progress: at the real shapes one row runs for minutes before its results are logged.
    log(f"    timing {', '.join(fns)} at N={n}, batch {row['batch']}: a warm-up call each, then "
        f"{repeats} round{'s' if repeats != 1 else ''} ...")
    timings = time_calls({**fns, **{name: call for name, (call, _) in also.items()}},
                         repeats=repeats, warmup=1)
    tokens = {}
    for name in fns:
        tokens[name] = np.asarray(timings[name]["result"])
        row[name] = without_result(timings[name])
        if name != "eqrope":
            del row[name]["first_compile"]  # jax's compile clock; torch has none
        log(f"    {name:<18} N={n:<4} batch {row['batch']:<2} median "
            f"{row[name]['median_s']:.4f} s (first {row[name]['first_s']:.3f} s)")
    for name, (_, record) in also.items():
        row[name] = record(timings[name])
    theirs = [k for k in contenders if k != "eqrope"]
    expected_len = prompt.shape[-1] + n
    row["tokens_len"] = {k: int(v.shape[-1]) for k, v in tokens.items()}
    row["first_difference"] = {k: first_difference(tokens["eqrope"], tokens[k]) for k in theirs}
    row["identical_tokens"] = {k: row["first_difference"][k] is None for k in theirs}
    row["all_full_length"] = all(v.shape[-1] == expected_len for v in tokens.values())
    for k in theirs:
        row[f"speedup_vs_{k}"] = row[k]["median_s"] / row["eqrope"]["median_s"]
    # transformers at its better torch thread count, measured in this same run.
    best = min(BEST_OF, key=lambda k: row[k]["median_s"])
    row["hf_best"] = {"contender": best, "median_s": row[best]["median_s"]}
    row["speedup_vs_hf_best"] = row[best]["median_s"] / row["eqrope"]["median_s"]
    return row


def target(name: str, row: dict, goal: float) -> dict:
    """eqrope against transformers' better of one torch thread and all threads."""
    measured = row["speedup_vs_hf_best"]
    return {"target": f"{name}: eqrope >= {goal:g}x transformers (better of 1 and all "
                      f"threads: {row['hf_best']['contender']})",
            "goal": goal, "measured": measured, "unit": "x", "met": measured >= goal}


def run_case(name: str, sizes: dict, prompt_len: int, ns, repeats: int, workdir: pathlib.Path,
             profile: bool) -> dict:
    log(f"[{name}] building and exporting {sizes}")
    model, hf_model = build_pair(sizes, workdir / name)
    prompt = np.arange(prompt_len, dtype=np.int64) % sizes["vocab_size"]
    case = {"case": name, "model": sizes, "params": eqrope.count_params(model), "rows": []}
    for n in ns:
        case["rows"].append(measure(model, hf_model, prompt, n, repeats))
    if profile:
        log(f"[{name}] profiling one decode step")
        case["profile"] = profile_step(model, hf_model, prompt_len, max(ns))
    return case


def run_real_case(name: str, cfg: dict) -> tuple[dict, list]:
    """One public shape at each batch of `cfg["real_batches"]`, and the batch-1 roofline."""
    family, _, source = _real_shapes.SHAPES[name]
    fields = _real_shapes.fields_of(name, cfg["real_tiny"])
    log(f"[{name}] {family} with random weights, built by transformers, read by eqrope.from_hf")
    with tempfile.TemporaryDirectory(prefix="eqrope_real_shape_") as directory:
        model, hf_model = _real_shapes.build_pair(name, cfg["real_tiny"], pathlib.Path(directory))
    case = {"case": name, "family": family,
            "source": f"{source} config.json" + (", shrunk (--tiny)" if cfg["real_tiny"] else ""),
            "hf_config": fields, "config": model.config.to_dict(),
            "params": eqrope.count_params(model), "rows": []}
    prompts = _real_shapes.prompts(fields["vocab_size"], max(cfg["real_batches"]), cfg["real_prompt"])
    targets = []
    for batch in cfg["real_batches"]:
        prompt = prompts[0] if batch == 1 else prompts[:batch]
        also = {}
        if batch == 1:
            copy = _real_shapes.copy_rate(cfg)
            probe, record = copy_probe(cfg["copy_mb"] * 2**20, cfg["copy_call_bytes"])
            also["xla_pass"] = (probe, lambda t: {**record(t), "convention": COPY_CONVENTION})
        row = measure(model, hf_model, prompt, cfg["real_new"], cfg["real_repeats"],
                      REAL_CONTENDERS, also)
        case["rows"].append(row)
        targets.append(target(f"{name} batch {batch}", row, 2 if batch == 1 else 3))
        if batch == 1:
            line = case["roofline"] = _real_shapes.roofline(model, row, copy, row.pop("xla_pass"))
            targets.append({
                "target": f"{name} batch 1: time per token >= 0.7 of the DRAM roofline (weight "
                          "bytes / copy rate; roofline / measured)",
                "goal": 0.7, "measured": line["fraction"], "unit": "", "met": line["fraction"] >= 0.7,
            })
            log(f"    per token {line['per_token_s'] * 1e3:.1f} ms, roofline "
                f"{line['roofline_per_token_s'] * 1e3:.1f} ms: {line['fraction']:.2f}")
    return case, targets


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_const", dest="mode", const="quick",
                      help="the default: 3 repeats on the chapter shape and the real shapes")
    size.add_argument("--full", action="store_const", dest="mode", const="full",
                      help="5 repeats everywhere")
    size.add_argument("--tiny", action="store_const", dest="mode", const="tiny",
                      help="tiny sizes, 1 repeat: a smoke run (seed and chapter unless --only)")
    add_output_arguments(parser, "folder for vs_transformers_cpu.json")
    parser.add_argument("--only", choices=("seed", "chapter", "real"),
                        help="run one case (the targets then report the cases that ran)")
    parser.add_argument("--profile", action="store_true",
                        help="also profile one decode step (seed and chapter cases)")
    parser.add_argument("--torch-threads", type=int, default=os.cpu_count() or 1,
                        help="torch intra-op threads (default os.cpu_count()); on a busy "
                             "machine torch's OpenMP threads stall each other, and 1 thread "
                             "shows by how much")
    args = parser.parse_args(argv)
    mode = args.mode or "quick"
    cfg = MODES[mode]
    out = args.out if args.out is not None else results_folder(args.save)
    run = (args.only,) if args.only else cfg["cases"]

    torch.set_num_threads(args.torch_threads)
    machine = machine_info()
    machine.update(torch=torch.__version__, transformers=transformers.__version__,
                   safetensors=importlib.metadata.version("safetensors"),
                   torch_threads=torch.get_num_threads(),
                   os_cpu_count=os.cpu_count(),
                   loadavg_1min_start=os.getloadavg()[0],
                   threads_note=f"torch.set_num_threads({args.torch_threads}) (os.cpu_count() = "
                                f"{os.cpu_count()}); XLA's CPU client uses all cores")
    start = time.perf_counter()
    workdir = out / "_vs_transformers_weights"
    cases, targets, extra = [], [], {}
    if "seed" in run:
        cases.append(run_case("seed", cfg["seed"], cfg["seed_prompt"], (cfg["seed_new"],),
                              cfg["seed_repeats"], workdir, args.profile))
        targets.append(target("seed protocol", cases[-1]["rows"][0], 20))
    if "chapter" in run:
        cases.append(run_case("chapter", cfg["chapter"], cfg["chapter_prompt"], cfg["chapter_n"],
                              cfg["chapter_repeats"], workdir, args.profile))
        last = cases[-1]["rows"][-1]
        targets.append(target(f"chapter shape N={last['new_tokens']}", last, 4))
    if "real" in run:
        # First, while this process holds little: the fresh process that measures memory.
        log(f"[memory] bfloat16 {_real_shapes.MEMORY_SHAPE} shape, max_position_embeddings "
            f"{_real_shapes.MEMORY_MAX_POSITIONS}, in a fresh process")
        with tempfile.TemporaryDirectory(prefix="eqrope_memory_") as directory:
            extra["memory"] = _real_shapes.memory_check(cfg, pathlib.Path(directory))
        for name in _real_shapes.SHAPES:
            case, case_targets = run_real_case(name, cfg)
            cases.append(case)
            targets += case_targets
        targets += memory_targets(extra["memory"])
    result = {
        "mode": mode,
        "machine": machine,
        "protocol": "greedy; per row, the contenders timed in rounds (time_calls): one warm-up "
                    "call each (first_s), then `repeats` rounds of one timed call each; seed and "
                    "chapter: eqrope's weights exported with eqrope.to_hf_llama; real shapes: "
                    "transformers' weights read with eqrope.from_hf",
        "cases": cases,
        **extra,
        "targets": targets,
        "reference_hf_default_s": REFERENCE_HF_DEFAULT_S,
        "total_s": time.perf_counter() - start,
    }
    if workdir.exists():
        for file in sorted(workdir.glob("*/*")):
            file.unlink()
        for folder in sorted(workdir.glob("*")):
            folder.rmdir()
        workdir.rmdir()
    path = write_json(out / "vs_transformers_cpu.json", result)
    print_vs_transformers(result)
    print(f"\nwrote {path} ({result['total_s']:.0f} s)")
    return result


if __name__ == "__main__":
    main()
