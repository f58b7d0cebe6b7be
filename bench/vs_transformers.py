"""eqrope beside Hugging Face transformers: the same random weights, greedy generation.

    python bench/vs_transformers.py            # --quick, the default (a few minutes on 2 cores)
    python bench/vs_transformers.py --full     # 5 repeats everywhere
    python bench/vs_transformers.py --tiny --out /tmp/x   # tiny sizes, 1 repeat (smoke run)
    python bench/vs_transformers.py --profile  # also: where a decode step's time goes
    python bench/vs_transformers.py --torch-threads 1 --out /tmp/t1   # torch on one thread
    python bench/vs_transformers.py --only seed --out /tmp/seed         # one case
    python bench/vs_transformers.py --save     # update the committed bench/results/

Needs the optional `[hf]` extra (torch and transformers). One process, one machine: torch
runs with `torch.set_num_threads(os.cpu_count())` intra-op threads, and XLA's CPU client
uses every core by default. Each eqrope model (random weights, zero head bias as
initialised) is exported with `eqrope.to_hf_llama` and loaded with
`transformers.LlamaForCausalLM.from_pretrained`, so both sides hold the same weights.

Contenders, all greedy, batch of one:

- `eqrope`: `eqrope.generate` with default arguments (the cached path: one compiled
  program, prefill then a loop of decode steps that stops after the last token; the
  cache has the smallest power of two of rows holding prompt and N, so the program
  compiles once per such length, and `max_new` is traced);
- `hf_default`: `model.generate(ids, max_new_tokens=N, do_sample=False)` (dynamic cache);
- `hf_static`: the same with `cache_implementation="static"` (on CPU transformers does not
  auto-compile, so this is eager PyTorch with a preallocated cache);
- `hf_default_1thread`: `hf_default` with `torch.set_num_threads(1)` for the call: on a
  machine shared with other work, torch's OpenMP threads wait on each other and its
  multi-threaded times grow many-fold; one thread shows by how much.

The targets (eqrope >= 20x transformers on the seed protocol, >= 4x on the chapter shape
at N=512) compare eqrope with transformers' better of `hf_default` and
`hf_default_1thread`, both measured in the same run (`hf_best`, `speedup_vs_hf_best`).

Cases: the seed's protocol (model (65, 64, 4, 2, 256), prompt of 8, 100 new tokens,
1 warm-up + 5 repeats) and the textbook chapter's timing shape (vocab 256, width 256,
4 heads, 4 blocks, d_ff 1024, max_len 1024, prompt of 4, N = 64, 128, 256, 512).

Writes `vs_transformers_cpu.json` to `--out` (default `bench/results/latest/`, ignored
by git; `--save` writes to the committed `bench/results/`) and prints a table. Targets
are reported (target, measured, met), never asserted. Timings are noisy when other work
shares the CPU.
"""

import argparse
import importlib.metadata
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import eqrope
from _timing import (add_output_arguments, log, machine_info, results_folder, time_call,
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

from _hf_profile import profile_step  # imports torch: after the check above


SEED_MODEL = dict(vocab_size=65, d_model=64, n_heads=4, n_blocks=2, max_len=256)
CHAPTER_MODEL = dict(vocab_size=256, d_model=256, n_heads=4, n_blocks=4, max_len=1024, d_ff=1024)
TINY_MODEL = dict(vocab_size=64, d_model=32, n_heads=2, n_blocks=2, max_len=64, d_ff=64)
# The reference numbers: transformers 5.24, torch 2.13, CPU, this kind of machine.
REFERENCE_HF_DEFAULT_S = {"seed": 0.089, "chapter_N512": 1.75}

MODES = {
    "quick": dict(seed=SEED_MODEL, seed_prompt=8, seed_new=100, seed_repeats=5,
                  chapter=CHAPTER_MODEL, chapter_prompt=4, chapter_n=(64, 128, 256, 512),
                  chapter_repeats=3),
    "full": dict(seed=SEED_MODEL, seed_prompt=8, seed_new=100, seed_repeats=5,
                 chapter=CHAPTER_MODEL, chapter_prompt=4, chapter_n=(64, 128, 256, 512),
                 chapter_repeats=5),
    "tiny": dict(seed=TINY_MODEL, seed_prompt=4, seed_new=8, seed_repeats=1,
                 chapter=TINY_MODEL, chapter_prompt=4, chapter_n=(8,), chapter_repeats=1),
}
CONTENDERS = ("eqrope", "hf_default", "hf_static", "hf_default_1thread")
HF_CONTENDERS = CONTENDERS[1:]
# The targets compare with the faster of these two: transformers' default generate on all
# torch threads and on one thread.
BEST_OF = ("hf_default", "hf_default_1thread")


def build_pair(sizes: dict, directory: pathlib.Path):
    """An eqrope model (key 0) and the transformers model holding the same weights."""
    model = eqrope.RotaryDecoder(**sizes, key=jax.random.PRNGKey(0))
    eqrope.to_hf_llama(model, directory)  # the initial head bias is zeros: dropped exactly
    hf_model = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return model, hf_model


def runners(model, hf_model, prompt: np.ndarray, n: int) -> dict:
    """For each contender, a no-argument call that returns the generated ids as numpy."""
    ids = torch.tensor(prompt, dtype=torch.long)[None]
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
            return out[0].numpy()

        return run

    return {
        "eqrope": ours,
        "hf_default": theirs(),
        "hf_static": theirs(cache_implementation="static"),
        "hf_default_1thread": theirs(threads=1),
    }


def measure(model, hf_model, prompt: np.ndarray, n: int, repeats: int) -> dict:
    """Time every contender (1 warm-up call, timed as the first call, then `repeats`)."""
    row = {
        "new_tokens": n,
        "prompt_len": int(prompt.shape[0]),
        "loadavg_1min_before": os.getloadavg()[0],
    }
    tokens = {}
    for name, fn in runners(model, hf_model, prompt, n).items():
        timing = time_call(fn, repeats=repeats, warmup=1)
        tokens[name] = np.asarray(timing["result"])
        row[name] = without_result(timing)
        if name != "eqrope":
            del row[name]["first_compile"]  # jax's compile clock; torch has none
        log(f"    {name:<18} N={n:<4} median {timing['median_s']:.4f} s "
            f"(first {timing['first_s']:.3f} s)")
    expected_len = prompt.shape[0] + n
    row["tokens_len"] = {k: int(v.shape[0]) for k, v in tokens.items()}
    row["identical_tokens"] = {
        k: bool(tokens[k].shape == tokens["eqrope"].shape and (tokens[k] == tokens["eqrope"]).all())
        for k in HF_CONTENDERS
    }
    row["all_full_length"] = all(v.shape[0] == expected_len for v in tokens.values())
    for k in HF_CONTENDERS:
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
            "goal": goal, "measured": measured, "met": measured >= goal}


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


def print_table(result: dict) -> None:
    m = result["machine"]
    print(f"\neqrope vs transformers, greedy, batch 1 ({result['mode']} mode, {m['date']})")
    print(f"machine: {m['cpu_model']}, {m['cpu_count']} CPUs; torch threads {m['torch_threads']}, "
          f"XLA CPU client on all cores; 1-min load average at start {m['loadavg_1min_start']:.1f}")
    print(f"python {m['python']}, jax {m['jax']}, equinox {m['equinox']}, torch {m['torch']}, "
          f"transformers {m['transformers']}")
    head = (f"{'case':<8} {'N':>4} | {'contender':<18} {'first (s)':>9} {'median (s)':>10} "
            f"{'min-max (s)':>15} | {'speedup':>7} | same tokens")
    print(head)
    print("-" * len(head))
    for case in result["cases"]:
        for row in case["rows"]:
            for k in CONTENDERS:
                t = row[k]
                speed = "" if k == "eqrope" else f"{row['speedup_vs_' + k]:6.1f}x"
                same = "" if k == "eqrope" else str(row["identical_tokens"][k])
                print(f"{case['case']:<8} {row['new_tokens']:>4} | {k:<18} {t['first_s']:9.3f} "
                      f"{t['median_s']:10.4f} {t['min_s']:7.4f}-{t['max_s']:<7.4f} | "
                      f"{speed:>7} | {same}")
    print("speedup = transformers median / eqrope median (eqrope's first call includes its "
          "compile, once per cache length)")
    for t in result["targets"]:
        verdict = "met" if t["met"] else "NOT met"
        print(f"target: {t['target']}: measured {t['measured']:.1f}x -> {verdict}")
    for case in result["cases"]:
        if "profile" in case:
            p = case["profile"]
            print(f"\n[{case['case']}] one decode step at position {p['position']}: eqrope "
                  f"{p['eqrope_step_median_s'] * 1e3:.2f} ms (compiled), transformers forward "
                  f"of one token {p['hf_forward_one_token_median_s'] * 1e3:.2f} ms")
            mb = p["weight_bytes"] / 1e6
            for side in ("xla", "torch"):
                t = p[f"{side}_weight_products_median_s"]
                print(f"  the step's weight products alone ({mb:.1f} MB of weights) in {side}: "
                      f"{t * 1e3:.2f} ms = {mb / 1e3 / t:.1f} GB/s")
            print(p["hf_top_ops"])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_const", dest="mode", const="quick",
                      help="the default: 3 repeats on the chapter shape")
    size.add_argument("--full", action="store_const", dest="mode", const="full",
                      help="5 repeats everywhere")
    size.add_argument("--tiny", action="store_const", dest="mode", const="tiny",
                      help="tiny sizes, 1 repeat: a smoke run")
    add_output_arguments(parser, "folder for vs_transformers_cpu.json")
    parser.add_argument("--only", choices=("seed", "chapter"),
                        help="run one case (the targets then report the cases that ran)")
    parser.add_argument("--profile", action="store_true", help="also profile one decode step")
    parser.add_argument("--torch-threads", type=int, default=os.cpu_count() or 1,
                        help="torch intra-op threads (default os.cpu_count()); on a busy "
                             "machine torch's OpenMP threads stall each other, and 1 thread "
                             "shows by how much")
    args = parser.parse_args(argv)
    mode = args.mode or "quick"
    cfg = MODES[mode]
    out = args.out if args.out is not None else results_folder(args.save)

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
    cases, targets = [], []
    if args.only in (None, "seed"):
        cases.append(run_case("seed", cfg["seed"], cfg["seed_prompt"], (cfg["seed_new"],),
                              cfg["seed_repeats"], workdir, args.profile))
        targets.append(target("seed protocol", cases[-1]["rows"][0], 20))
    if args.only in (None, "chapter"):
        cases.append(run_case("chapter", cfg["chapter"], cfg["chapter_prompt"], cfg["chapter_n"],
                              cfg["chapter_repeats"], workdir, args.profile))
        last = cases[-1]["rows"][-1]
        targets.append(target(f"chapter shape N={last['new_tokens']}", last, 4))
    result = {
        "mode": mode,
        "machine": machine,
        "protocol": "greedy, batch 1; per contender one warm-up call (reported as first_s), then "
                    "`repeats` timed calls; same random weights via eqrope.to_hf_llama",
        "cases": cases,
        "targets": targets,
        "reference_hf_default_s": REFERENCE_HF_DEFAULT_S,
        "total_s": time.perf_counter() - start,
    }
    for file in sorted(workdir.glob("*/*")):
        file.unlink()
    for folder in sorted(workdir.glob("*")):
        folder.rmdir()
    workdir.rmdir()
    path = write_json(out / "vs_transformers_cpu.json", result)
    print_table(result)
    print(f"\nwrote {path} ({result['total_s']:.0f} s)")
    return result


if __name__ == "__main__":
    main()
