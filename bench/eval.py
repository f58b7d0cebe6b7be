"""lm-eval with eqrope's model against lm-eval's own `hf` model, and scoring throughput.

    python bench/eval.py                       # the SmolLM2-135M shape (long: a quiet machine)
    python bench/eval.py --quick --out /tmp/x  # tiny sizes, one repeat (for the tests)
    python bench/eval.py --save                # update bench/results/eval_cpu.json

Needs the `[eval]` extra and lm-eval's `hf` model (torch, transformers, accelerate).
Writes `eval_cpu.json` to `--out` (default `bench/results/latest/`, ignored by git;
`--save` writes `bench/results/eval_cpu.json`) and prints a table. Nothing is downloaded:

1. A checkpoint of the SmolLM2-135M shape (sizes from `_shapes.SMOLLM2_135M`:
   hidden 576, 30 layers, 9 heads, 3 key/value heads, d_ff 1536, vocabulary 49152, tied
   embeddings), random float32 weights, built with transformers' `LlamaConfig` and
   `save_pretrained`, beside a byte-level BPE tokenizer trained with `tokenizers` on the
   tasks' text (its ids are a prefix of the model's vocabulary).
2. Two local tasks written as YAML over JSON Lines files (`dataset_path: json`): a
   4-choice task of 200 questions (a passage of invented words and a question about it;
   `acc`, `acc_norm`) and a `generate_until` task of 50 prompts (`until: ["\\n\\n"]`,
   `max_gen_toks` 32, greedy; `exact_match`).
3. `lm_eval.simple_evaluate` of both tasks on eqrope's model (`eqrope.eval.LM`) and on
   lm-eval's `hf` model (`HFLM`, float32, on the CPU), at each of several batch sizes.
   The runs are timed in rounds (`_timing.time_calls`, calls interleaved, so that load
   from other processes falls on all alike): a warm-up run each, reported apart with its
   compile seconds (`first_s`, `first_compile`), then `repeats` timed runs (median, min,
   max). The best batch size of each is the one with the lowest median; the speedup is
   the ratio of the two best medians (target >= 3). Both best runs' samples are compared
   request by request (log-likelihoods, `is_greedy`, generated strings, metrics).
4. Scoring throughput: `eqrope.score` of a batch of 16 rows of 256 random tokens on the
   same model, timed in rounds with XLA's float32 matmuls at the shapes of that pass
   (`(16 * 256, in) @ (in, out)` for every weight matrix and the tied head, as
   `_bounds.weight_matrices` lists them). FLOPs count the matmuls only, `2 * params *
   tokens`, on both sides, so the fraction is matmul time / scoring time (target >= 0.5).

Targets are reported (target, measured, met), never asserted.
"""

import argparse
import os
import pathlib
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import eqrope
import eqrope.eval
from _bounds import weight_matrices
from _eval_data import write_checkpoint, write_tasks
from _report import TARGETS_NOTE, verdict
from _timing import (
    _version,
    add_output_arguments,
    compile_seconds,
    log,
    machine_info,
    results_folder,
    time_calls,
    without_result,
    write_json,
)


MODES = {
    "full": dict(
        tiny=False,
        questions=200,
        prompts=50,
        max_gen_toks=32,
        repeats=2,
        eqrope_batches=(16, 64),
        hf_batches=(8, 32),
        score_batch=16,
        score_len=256,
        score_repeats=5,
    ),
    "quick": dict(
        tiny=True,
        questions=12,
        prompts=4,
        max_gen_toks=8,
        repeats=1,
        eqrope_batches=(4,),
        hf_batches=(4,),
        score_batch=2,
        score_len=32,
        score_repeats=1,
    ),
}


# -- lm-eval runs ---------------------------------------------------------------------------


def evaluate(folder: pathlib.Path, task_folder: pathlib.Path, cfg: dict) -> dict:
    """Every (model, batch size) run through `simple_evaluate`, timed in rounds."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(task_folder))
    tasks = ["bench_choice", "bench_until"]
    models = {}
    for batch in cfg["eqrope_batches"]:
        models[f"eqrope, batch {batch}"] = (
            "eqrope",
            batch,
            eqrope.eval.LM(pretrained=str(folder), batch_size=batch),
        )
    for batch in cfg["hf_batches"]:
        models[f"hf, batch {batch}"] = (
            "hf",
            batch,
            HFLM(pretrained=str(folder), device="cpu", dtype="float32", batch_size=batch),
        )

    def run(lm):
        return lambda: lm_eval.simple_evaluate(
            model=lm, tasks=tasks, task_manager=manager, log_samples=True, bootstrap_iters=0
        )

    log(f"  simple_evaluate: {', '.join(models)}; warm-up and {cfg['repeats']} rounds")
    timed = time_calls(
        {name: run(lm) for name, (_, _, lm) in models.items()}, repeats=cfg["repeats"]
    )
    runs, best = {}, {}
    for name, (kind, batch, _) in models.items():
        runs[name] = {"model": kind, "batch_size": batch, **without_result(timed[name])}
        log(
            f"  {name}: first {timed[name]['first_s']:.1f} s, "
            f"median {timed[name]['median_s']:.1f} s"
        )
        if kind not in best or timed[name]["median_s"] < timed[best[kind]]["median_s"]:
            best[kind] = name
    ours, theirs = timed[best["eqrope"]]["result"], timed[best["hf"]]["result"]
    return {
        "tasks": tasks,
        "runs": runs,
        "best": best,
        "speedup_median": runs[best["hf"]]["median_s"] / runs[best["eqrope"]]["median_s"],
        "speedup_first": runs[best["hf"]]["first_s"] / runs[best["eqrope"]]["first_s"],
        "requests": {task: len(ours["samples"][task]) for task in tasks},
        "agreement": agreement(ours, theirs),
        "metrics": {"eqrope": metrics(ours), "hf": metrics(theirs)},
    }


def metrics(results: dict) -> dict:
    return {
        task: {k: v for k, v in values.items() if k not in ("name", "alias") and "stderr" not in k}
        for task, values in results["results"].items()
    }


def agreement(ours: dict, theirs: dict) -> dict:
    """Request by request: the largest log-likelihood difference, `is_greedy` and
    generated strings equal, and the metrics equal."""
    diffs, greedy_equal, greedy_total, texts_equal, texts_total = [], 0, 0, 0, 0
    for a, b in zip(
        ours["samples"]["bench_choice"], theirs["samples"]["bench_choice"], strict=True
    ):
        for (ll_a, g_a), (ll_b, g_b) in zip(
            [r[0] for r in a["resps"]], [r[0] for r in b["resps"]], strict=True
        ):
            diffs.append(abs(ll_a - ll_b))
            greedy_equal += g_a == g_b
            greedy_total += 1
    for a, b in zip(ours["samples"]["bench_until"], theirs["samples"]["bench_until"], strict=True):
        texts_equal += a["resps"][0][0] == b["resps"][0][0]
        texts_total += 1
    return {
        "max_abs_loglikelihood_diff": max(diffs),
        "is_greedy_equal": f"{greedy_equal}/{greedy_total}",
        "generated_equal": f"{texts_equal}/{texts_total}",
        "metrics_equal": metrics(ours) == metrics(theirs),
    }


# -- scoring throughput --------------------------------------------------------------------


def scoring(folder: pathlib.Path, cfg: dict) -> dict:
    model = eqrope.from_hf(folder)
    batch, length = cfg["score_batch"], cfg["score_len"]
    tokens = (
        np.random.default_rng(0).integers(0, model.vocab_size, (batch, length)).astype(np.int32)
    )
    matrices = weight_matrices(model)
    params = sum(int(w.size) for w in matrices)
    # One input per width (the blocks' matrices of one kind share it), random float32.
    widths = sorted({int(w.shape[0]) for w in matrices})
    keys = jax.random.split(jax.random.PRNGKey(1), len(widths))
    inputs = {
        n: jax.random.normal(k, (batch * length, n), jnp.float32) for k, n in zip(keys, widths)
    }
    xs = [inputs[int(w.shape[0])] for w in matrices]
    products = jax.jit(lambda xs, ws: [x @ w for x, w in zip(xs, ws)])
    t = time_calls(
        {
            "score": lambda: eqrope.score(model, tokens).total,
            "matmul": lambda: products(xs, matrices),
        },
        repeats=cfg["score_repeats"],
    )
    tokens_per_s = batch * length / t["score"]["median_s"]
    score_flops = 2 * params * tokens_per_s
    matmul_flops = 2 * params * batch * length / t["matmul"]["median_s"]
    log(
        f"  score: {tokens_per_s:,.0f} tokens/s = {score_flops / 1e9:.1f} GFLOP/s; matmuls "
        f"{matmul_flops / 1e9:.1f} GFLOP/s"
    )
    return {
        "batch": batch,
        "length": length,
        "matmul_params": params,
        "shapes": [[batch * length, *map(int, w.shape)] for w in matrices],
        "score": without_result(t["score"]),
        "matmul": without_result(t["matmul"]),
        "tokens_per_s": tokens_per_s,
        "score_flops_per_s": score_flops,
        "matmul_flops_per_s": matmul_flops,
        "fraction_of_matmul": score_flops / matmul_flops,
        "convention": (
            "eqrope.score(model, tokens (batch, length)) scores length - 1 tokens per row in "
            "one plain pass over `length` positions; FLOPs = 2 * matmul_params * batch * "
            "length on both sides (the matmuls only: attention's and the softmax's work is "
            "not counted); matmul: jax.jit of x @ w for every weight matrix at x = "
            "(batch * length, in), float32; timed in rounds"
        ),
    }


# -- report ---------------------------------------------------------------------------------


def target(name, goal, measured, met) -> dict:
    return {"name": name, "target": goal, "measured": measured, "met": bool(met)}


def table(result: dict) -> str:
    m, e, s = result["machine"], result["lm_eval"], result["scoring"]
    lines = [
        f"eqrope eval benchmark ({result['mode']}), {m['cpu_model']}, {m['cpu_count']} CPUs, "
        f"jax {m['jax']}, lm-eval {m['lm_eval']}, transformers {m['transformers']}, "
        f"torch {m['torch']}",
        "",
        f"simple_evaluate, {e['requests']} requests: seconds",
        f"  {'run':<18}{'first':>8}{'compile':>9}{'median':>9}{'min-max':>16}",
    ]
    for name, r in e["runs"].items():
        compiled = r["first_compile"]["compile_s"] if r["model"] == "eqrope" else 0.0
        lines.append(
            f"  {name:<18}{r['first_s']:>8.1f}{compiled:>9.1f}{r['median_s']:>9.1f}"
            f"{r['min_s']:>8.1f}-{r['max_s']:.1f}"
        )
    a = e["agreement"]
    lines += [
        f"  best: {e['best']['eqrope']} against {e['best']['hf']}: {e['speedup_median']:.2f}x "
        f"(medians), {e['speedup_first']:.2f}x (first runs, compiles included)",
        f"  agreement: max |log-likelihood diff| {a['max_abs_loglikelihood_diff']:.2g}, is_greedy "
        f"equal {a['is_greedy_equal']}, generated equal {a['generated_equal']}, metrics equal "
        f"{a['metrics_equal']}",
        "",
        f"score, batch {s['batch']} x {s['length']}: {s['tokens_per_s']:,.0f} tokens/s = "
        f"{s['score_flops_per_s'] / 1e9:.1f} GFLOP/s; matmuls at its shapes "
        f"{s['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s ({s['fraction_of_matmul']:.2f})",
        "",
        "targets:",
        TARGETS_NOTE,
    ]
    for t in result["targets"]:
        lines.append(
            f"  {t['name']:<48} {t['target']:>6}  {t['measured']:>8.3g}  {verdict(t['met'])}"
        )
    lines.append(
        f"\nwall time {result['wall_s']:.0f} s, of which XLA compile "
        f"{result['compile_total']['compile_s']:.0f} s"
    )
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick",
        action="store_const",
        dest="mode",
        const="quick",
        default="full",
        help="tiny sizes and one repeat, for the tests",
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=os.cpu_count() or 1,
        help="torch intra-op threads of lm-eval's hf model (default os.cpu_count())",
    )
    parser.add_argument("--questions", type=int, help="override the number of questions")
    parser.add_argument("--prompts", type=int, help="override the number of generation prompts")
    add_output_arguments(parser, "folder for eval_cpu.json")
    args = parser.parse_args(argv)
    cfg = dict(MODES[args.mode])
    for name in ("questions", "prompts"):
        if getattr(args, name) is not None:
            cfg[name] = getattr(args, name)
    out = args.out if args.out is not None else results_folder(args.save)
    start = time.perf_counter()
    import torch

    torch.set_num_threads(args.torch_threads)
    machine = machine_info()
    machine.update(
        {
            name: _version(name)
            for name in ("lm_eval", "transformers", "torch", "accelerate", "datasets", "tokenizers")
        },
        torch_threads=torch.get_num_threads(),
    )
    result = {"mode": args.mode, "machine": machine, "sizes": dict(cfg)}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        os.environ.update(
            HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(tmp / "datasets")
        )
        (tmp / "tasks").mkdir()
        (tmp / "checkpoint").mkdir()
        log(f"[{args.mode}] checkpoint and tasks")
        corpus = write_tasks(cfg, tmp / "tasks")
        result["checkpoint"] = write_checkpoint(cfg, corpus, tmp / "checkpoint")
        log(f"[{args.mode}] lm-eval ({time.perf_counter() - start:.0f} s)")
        result["lm_eval"] = evaluate(tmp / "checkpoint", tmp / "tasks", cfg)
        log(f"[{args.mode}] scoring throughput ({time.perf_counter() - start:.0f} s)")
        result["scoring"] = scoring(tmp / "checkpoint", cfg)
    e, s = result["lm_eval"], result["scoring"]
    result["targets"] = [
        target(
            "lm-eval: eqrope / hf speedup (best medians)",
            ">= 3",
            e["speedup_median"],
            e["speedup_median"] >= 3,
        ),
        target(
            f"score {s['batch']} x {s['length']}: fraction of matmul rate",
            ">= 0.5",
            s["fraction_of_matmul"],
            s["fraction_of_matmul"] >= 0.5,
        ),
    ]
    result["compile_total"] = compile_seconds()
    result["wall_s"] = time.perf_counter() - start
    path = write_json(out / "eval_cpu.json", result)
    print(table(result))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
