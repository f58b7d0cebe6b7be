"""Speculative decoding against plain `generate`: acceptance, target steps, wall time.

    python bench/speculative.py             # the real run: a few minutes on 2 cores
    python bench/speculative.py --quick     # tiny sizes, 1 repeat (for the tests)
    python bench/speculative.py --train     # retrain the target/draft pair first
    python bench/speculative.py --save      # update the committed bench/results/

The models are a trained pair (`_speculative_pair.py`) on the task of
`_speculative_task.py` (a small character-level language and a copying task in its
alphabet): the target is the growth size (4 blocks, width 256), the draft one block of
width 64, both read from `bench/checkpoints/speculative/` (`--train` retrains and
rewrites them). The cases:

- `draft`: the target with the trained draft, on prompts that start a sentence;
- `prompt_lookup`: the target with `draft="prompt_lookup"`, on copying prompts (a text,
  the separator `|`, the text's first two characters);
- `self`: the target as its own draft, on the sentence prompts: acceptance near 1, and
  target steps per row within the bound `ceil(max_new / (k + 1)) + 1`;
- `draft, sampling`: the `draft` case at temperature 0.8 (accept="residual"), for its
  acceptance; its tokens differ from plain sampling's by design and are not compared.

Each case runs at batch 1 and batch 8 (`--quick`: 1 and 2), with `draft_len` k = 4 (and
the sweep `ks` for the first two cases), greedy unless said. Speculative and plain
`generate` are timed in the same run, their calls interleaved (`_timing.time_calls`):
one warm-up call, then `repeats` timed calls each (15; 1 in the quick mode); compile time
is the first call minus the median (about 0 for a program an earlier case compiled).
Reported per case: acceptance (accepted / drafted tokens, summed over rows; a round
offers `draft_len` drafts, or fewer when the row may add fewer tokens, so a draft that
always agrees reads 1), target passes per generated token, the speedup (plain median /
speculative median), and whether the tokens equal plain `generate`'s.

Writes `speculative_cpu.json` to `--out` (default `bench/results/latest/`, ignored by
git; `--save` writes to the committed `bench/results/`) and prints a table.
"""

import argparse
import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

import eqrope
import _speculative_pair as pair
import _speculative_task as task
from _timing import (add_output_arguments, compile_seconds, log, machine_info, results_folder,
                     time_calls, without_result, write_json)


MODES = {
    "default": dict(batches=(1, 8), ks=(2, 4, 6), k=4, language_new=128, repeats=15,
                    sampling_batch=8, temperature=0.8),
    # One batch size: the tests check the figures' consistency, not each batch size.
    "quick": dict(batches=(2,), ks=(4,), k=4, language_new=8, repeats=1,
                  sampling_batch=2, temperature=0.8),
}
COPY_GIVEN = 2  # copied characters already in a copying prompt
PROMPT_SEED = 0


def prompts(kind: str, batch: int, quick: bool) -> tuple[np.ndarray, np.ndarray, int, list]:
    """`(prompt, lengths, max_new, texts)` for `kind` ("language" or "copy") at `batch`
    rows; batch 1 is the first row of every larger batch. A copying case's `max_new` is its
    longest remaining copy (its rows with shorter texts go on with new sentences), at most
    8 in the quick mode; `texts` are the copied texts (empty for language prompts)."""
    if kind == "language":
        prompt, lengths = task.language_prompts(batch, PROMPT_SEED)
        texts, max_new = [], MODES["quick" if quick else "default"]["language_new"]
    else:
        prompt, lengths, texts = task.copy_prompts(batch, PROMPT_SEED, given=COPY_GIVEN)
        max_new = max(len(t) for t in texts) - COPY_GIVEN
        max_new = min(max_new, 8) if quick else max_new
    prompt = prompt[:, : int(lengths.max())]
    return prompt, lengths, max_new, texts


def measure(target, draft, *, name: str, kind: str, k: int, batch: int, repeats: int,
            quick: bool, temperature: float = 0.0) -> dict:
    """One case: plain and speculative `generate` on the same prompts, timed together."""
    prompt, lengths, max_new, texts = prompts(kind, batch, quick)
    # One row is a 1-D prompt (lengths unused); a batch is ragged, padded on the right.
    args = (jnp.asarray(prompt[0, : lengths[0]]),) if batch == 1 else (jnp.asarray(prompt),)
    settings = dict(return_logprobs=True, temperature=temperature)
    if batch > 1:
        settings["prompt_lengths"] = jnp.asarray(lengths)
    if temperature > 0:
        settings["key"] = jax.random.PRNGKey(0)
    calls = {
        "plain": lambda: eqrope.generate(target, *args, max_new, **settings),
        "speculative": lambda: eqrope.generate(target, *args, max_new, draft=draft, draft_len=k,
                                               **settings),
    }
    timing = time_calls(calls, repeats=repeats, warmup=1)
    plain, spec = timing["plain"]["result"], timing["speculative"]["result"]
    rows = {
        "prompt_lengths": np.atleast_1d(lengths[:batch]),
        "new_tokens": np.atleast_1d(np.asarray(spec.lengths)) - lengths[:batch],
        "plain_new_tokens": np.atleast_1d(np.asarray(plain.lengths)) - lengths[:batch],
        "target_steps": np.atleast_1d(np.asarray(spec.target_steps)),
        "plain_target_steps": np.atleast_1d(np.asarray(plain.target_steps)),
        "drafted": np.atleast_1d(np.asarray(spec.drafted)),
        "accepted": np.atleast_1d(np.asarray(spec.accepted)),
    }
    rows = {key: [int(x) for x in value] for key, value in rows.items()}
    totals = {key: sum(value) for key, value in rows.items() if key != "prompt_lengths"}
    record = {
        "case": name, "prompts": kind, "draft": _draft_name(draft, target), "draft_len": k,
        "batch": batch, "max_new": max_new, "temperature": temperature,
        "plain": without_result(timing["plain"]),
        "speculative": without_result(timing["speculative"]),
        "compile_s": {p: timing[p]["first_s"] - timing[p]["median_s"] for p in timing},
        "rows": rows, **totals,
        "acceptance": totals["accepted"] / totals["drafted"] if totals["drafted"] else None,
        "target_steps_per_token": totals["target_steps"] / totals["new_tokens"],
        "plain_target_steps_per_token": totals["plain_target_steps"] / totals["plain_new_tokens"],
        "speedup": timing["plain"]["median_s"] / timing["speculative"]["median_s"],
    }
    if temperature == 0:
        record["identical_tokens"] = bool(
            np.array_equal(np.asarray(plain.tokens), np.asarray(spec.tokens))
            and np.array_equal(np.asarray(plain.lengths), np.asarray(spec.lengths)))
    else:
        record["identical_tokens"] = None  # sampling: same distribution, other tokens
    if draft is target:
        record["bound"] = math.ceil(max_new / (k + 1)) + 1
        record["within_bound"] = max(rows["target_steps"]) <= record["bound"]
    if texts:
        # The rows whose new tokens (up to the end of the copy) are the text's.
        tokens = np.atleast_2d(np.asarray(plain.tokens))
        ends = np.atleast_1d(np.asarray(plain.lengths))
        copied = [task.decode(tokens[i, n : min(end, n + len(t) - COPY_GIVEN)])
                  for i, (n, end, t) in enumerate(zip(lengths, ends, texts))]
        record["plain_copies"] = sum(
            c == t[COPY_GIVEN : COPY_GIVEN + len(c)] for c, t in zip(copied, texts)) / batch
    return record


def _draft_name(draft, target) -> str:
    if isinstance(draft, str):
        return draft
    if draft is target:
        return "target"
    config = draft.config
    return f"draft ({config.n_blocks} block, width {config.d_model})"


def table(result: dict) -> str:
    m = result["machine"]
    lines = [f"eqrope speculative decoding ({result['mode']}), {m['cpu_model']}, "
             f"{m['cpu_count']} CPUs, jax {m['jax']}",
             f"target {result['models']['target']['params']:,} params, draft "
             f"{result['models']['draft']['params']:,} params; times are medians of "
             f"{result['sizes']['repeats']} (min-max), ms",
             "",
             f"  {'case':<16}{'k':>2}{'batch':>6}{'new':>5}{'accept':>8}{'steps/tok':>10}"
             f"{'plain':>18}{'speculative':>20}{'speedup':>8}{'compile s':>11}  same tokens"]
    ms = lambda t: f"{t['median_s'] * 1e3:.1f} ({t['min_s'] * 1e3:.0f}-{t['max_s'] * 1e3:.0f})"
    for c in result["cases"]:
        accept = "-" if c["acceptance"] is None else f"{c['acceptance']:.3f}"
        same = {True: "yes", False: "NO", None: "n/a (sampled)"}[c["identical_tokens"]]
        if "bound" in c:
            steps = max(c["rows"]["target_steps"])
            same += f"; steps {steps} <= bound {c['bound']}: {c['within_bound']}"
        if "plain_copies" in c:
            same += f"; plain copies {c['plain_copies']:.2f}"
        lines.append(
            f"  {c['case']:<16}{c['draft_len']:>2}{c['batch']:>6}{c['max_new']:>5}{accept:>8}"
            f"{c['target_steps_per_token']:>10.3f}{ms(c['plain']):>18}{ms(c['speculative']):>20}"
            f"{c['speedup']:>7.2f}x{c['compile_s']['speculative']:>11.1f}  {same}")
    lines.append(f"\nwall time {result['wall_s']:.1f} s, of which XLA compile "
                 f"{result['compile_total']['compile_s']:.1f} s")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes and 1 repeat, for the tests")
    parser.add_argument("--train", action="store_true",
                        help="retrain the target/draft pair (about 11 minutes on 2 cores) and "
                        "rewrite bench/checkpoints/speculative/")
    add_output_arguments(parser, "folder for speculative_cpu.json")
    args = parser.parse_args(argv)
    mode = "quick" if args.quick else "default"
    cfg = MODES[mode]
    out = args.out if args.out is not None else results_folder(args.save)
    start = time.perf_counter()
    if args.train:
        pair.train_pair(log=log)
    try:
        target, draft = pair.load_pair()
    except FileNotFoundError as e:
        parser.exit(2, f"{e}\n")
    train_file = pair.CHECKPOINTS / "train.json"
    models = {name: {"params": eqrope.count_params(m), "config": m.config.to_dict()}
              for name, m in (("target", target), ("draft", draft))}
    if train_file.is_file():
        models["training"] = json.loads(train_file.read_text())

    result = {"mode": mode, "machine": machine_info(), "sizes": dict(cfg), "models": models,
              "cases": []}
    plan = [("draft", draft, "language", k) for k in cfg["ks"]]
    plan += [("prompt_lookup", "prompt_lookup", "copy", k) for k in cfg["ks"]]
    plan += [("self", target, "language", cfg["k"])]
    for name, d, kind, k in plan:
        for batch in cfg["batches"]:
            log(f"[{mode}] {name}, k={k}, batch {batch} ({time.perf_counter() - start:.0f} s)")
            result["cases"].append(measure(target, d, name=name, kind=kind, k=k, batch=batch,
                                           repeats=cfg["repeats"], quick=args.quick))
    log(f"[{mode}] draft, sampling ({time.perf_counter() - start:.0f} s)")
    result["cases"].append(measure(target, draft, name="draft, sampling", kind="language",
                                   k=cfg["k"], batch=cfg["sampling_batch"], repeats=cfg["repeats"],
                                   quick=args.quick, temperature=cfg["temperature"]))
    result["compile_total"] = compile_seconds()
    result["wall_s"] = time.perf_counter() - start
    path = write_json(out / "speculative_cpu.json", result)
    print(table(result))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
