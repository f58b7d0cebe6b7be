"""What low-rank adapters cost and save: training, generating, many adapters at once.

    python bench/adapters.py                     # the SmolLM2-135M shape (a few minutes on 2 cores)
    python bench/adapters.py --tiny --out /tmp/x # shrunk sizes, 1 repeat (for the tests)
    python bench/adapters.py --save              # update the committed bench/results/

The model has the published shape of SmolLM2-135M (`_shapes.SMOLLM2_135M`: 30
blocks, width 576, 9 heads, 3 key/value heads, d_ff 1536, a tied 49152-row embedding),
random weights, float32. Each figure is timed after a warm-up call, as the median and
min/max of the repeats, the first (compiling) call reported on its own, with the calls of
the functions compared interleaved round by round (`_timing.time_calls`):

1. `train`: one adam step on a batch of 4 x 128 tokens: the full fine-tune
   (`eqrope.make_train_step`) against a rank-8 adapter on all seven targets
   (`eqrope.make_adapter_train_step`); and the bytes of the two optimizer states.
2. `generate`: greedy generation for 4 rows with an unmerged adapter against the merged
   model (`eqrope.merge`), both unstacked, identical tokens checked.
3. `many`: 8 rows, each with its own adapter of 8 (`eqrope.select_adapters`) against
   one adapter for all 8 rows; each row checked against its adapter's own tokens.

Writes `adapters_cpu.json` (machine, versions, every timing, the targets) to `--out`
(default `bench/results/latest/`, ignored by git; `--save`: `bench/results/`) and prints
a table. Targets are reported (target, measured, met), never asserted.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import eqrope
from _shapes import SMOLLM2_135M as HF_SMOLLM2_135M, eqrope_config
from _report import fmt, target, timing_head, timing_row, verdict
from _timing import add_output_arguments, log, machine_info, results_folder, time_calls, without_result, write_json


# The published SmolLM2-135M shape as eqrope's config; max_len only bounds caches.
SMOLLM2_135M = eqrope_config(HF_SMOLLM2_135M, max_len=2048)
TINY = dict(SMOLLM2_135M, vocab_size=256, d_model=72, n_blocks=2, d_ff=32, max_len=256)
ALL = ("q", "k", "v", "o", "gate", "up", "down")
MODES = {
    "default": dict(shape=SMOLLM2_135M, batch=4, seq=128, rank=8, repeats=5, rows=4, many=8,
                    prompt=32, max_new=64),
    # rows == many: the generate section's unmerged program is the many section's one_adapter's.
    "tiny": dict(shape=TINY, batch=2, seq=16, rank=8, repeats=1, rows=3, many=3, prompt=8,
                 max_new=8),
}


def nbytes(tree) -> int:
    return int(sum(x.nbytes for x in jax.tree.leaves(tree) if hasattr(x, "nbytes")))


def adapter(base, seed: int, rank: int):
    """A rank-`rank` adapter on all seven targets with non-zero `B` (as after training)."""
    model = eqrope.lora(base, rank=rank, alpha=2.0 * rank, targets=ALL, key=jax.random.key(seed))
    rng = np.random.default_rng(seed)

    def redraw(x):
        if not isinstance(x, eqrope.LowRank):
            return x
        b = jnp.asarray(0.02 * rng.standard_normal(x.b.shape), x.b.dtype)
        return eqrope.LowRank(x.a, b, alpha=x.alpha, rslora=x.rslora, dropout=x.dropout)

    return jax.tree.map(redraw, model, is_leaf=lambda x: isinstance(x, eqrope.LowRank))


def train(base, cfg) -> dict:
    opt = optax.adam(1e-4)
    data = np.random.default_rng(0).integers(0, base.vocab_size, (cfg["batch"], cfg["seq"] + 1))
    x, y = jnp.asarray(data[:, :-1], jnp.int32), jnp.asarray(data[:, 1:], jnp.int32)
    adapted = adapter(base, 1, cfg["rank"])
    full_state = eqrope.init_optimizer(opt, base)
    lora_state = eqrope.init_adapter_optimizer(opt, adapted)
    full_step, lora_step = eqrope.make_train_step(opt), eqrope.make_adapter_train_step(opt)
    # Each call starts from the same model and state; only the loss is kept between calls.
    calls = {
        "full": lambda: full_step(base, full_state, x, y)[2],
        "adapter": lambda: lora_step(adapted, lora_state, x, y)[2],
    }
    timings = time_calls(calls, repeats=cfg["repeats"], warmup=1)
    state_bytes = {"full": nbytes(full_state), "adapter": nbytes(lora_state)}
    params = sum(p.a.size + p.b.size for p in jax.tree.leaves(adapted, is_leaf=lambda x: isinstance(x, eqrope.LowRank)) if isinstance(p, eqrope.LowRank))
    return {
        "batch": cfg["batch"], "seq": cfg["seq"], "rank": cfg["rank"], "targets": list(ALL),
        "adapter_params": int(params), "model_params": eqrope.count_params(base),
        "timings": {k: without_result(v) for k, v in timings.items()},
        "optimizer_state_nbytes": state_bytes,
        "time_ratio": timings["adapter"]["median_s"] / timings["full"]["median_s"],
        "state_ratio": state_bytes["adapter"] / state_bytes["full"],
    }  # fmt: skip


def generation(base, cfg) -> dict:
    prompts = np.random.default_rng(1).integers(0, base.vocab_size, (cfg["rows"], cfg["prompt"]))
    adapted = adapter(base, 2, cfg["rank"]).unstacked()
    merged = eqrope.merge(adapted)
    n = cfg["max_new"]
    calls = {"unmerged": lambda: eqrope.generate(adapted, prompts, n),
             "merged": lambda: eqrope.generate(merged, prompts, n)}
    timings = time_calls(calls, repeats=cfg["repeats"], warmup=1)
    same = np.array_equal(timings["unmerged"]["result"], timings["merged"]["result"])
    return {
        "rows": cfg["rows"], "prompt": cfg["prompt"], "max_new": n,
        "timings": {k: without_result(v) for k, v in timings.items()},
        "identical_tokens": bool(same),
        "ratio": timings["unmerged"]["median_s"] / timings["merged"]["median_s"],
    }  # fmt: skip


def many(base, cfg) -> dict:
    k = cfg["many"]
    prompts = np.random.default_rng(2).integers(0, base.vocab_size, (k, cfg["prompt"]))
    adapters = [adapter(base, 10 + i, cfg["rank"]).unstacked() for i in range(k)]
    stack = eqrope.stack_adapters(adapters)
    ids = np.arange(k, dtype=np.int32)
    n = cfg["max_new"]
    calls = {"one_adapter": lambda: eqrope.generate(adapters[0], prompts, n),
             "k_adapters": lambda: eqrope.generate(eqrope.select_adapters(stack, ids), prompts, n)}
    timings = time_calls(calls, repeats=cfg["repeats"], warmup=1)
    out = timings["k_adapters"]["result"]
    # Row i against adapter i's own run on the same batch (rows are independent): the
    # one_adapter program again, not one more for a single row.
    rows = [bool(np.array_equal(out[i], np.asarray(eqrope.generate(adapters[i], prompts, n))[i])) for i in range(k)]
    return {
        "rows": k, "adapters": k, "prompt": cfg["prompt"], "max_new": n,
        "timings": {name: without_result(v) for name, v in timings.items()},
        "rows_equal_own_adapter": rows,
        "ratio": timings["k_adapters"]["median_s"] / timings["one_adapter"]["median_s"],
    }  # fmt: skip


def targets(result: dict) -> list[dict]:
    t, g, m = result["train"], result["generate"], result["many"]
    return [
        target("adapter train step / full fine-tune step (medians)", "<= 0.6", t["time_ratio"], t["time_ratio"] <= 0.6),
        target("adapter optimizer state / full optimizer state", "<= 0.02", t["state_ratio"], t["state_ratio"] <= 0.02),
        target("generate, unmerged adapter / merged (medians)", "<= 1.15", g["ratio"], g["ratio"] <= 1.15),
        target(f"{m['adapters']} adapters in {m['rows']} rows / one adapter (medians)", "<= 1.3", m["ratio"], m["ratio"] <= 1.3),
    ]  # fmt: skip


def table(result: dict) -> str:
    row = lambda name, r: timing_row(name, r, 22)  # noqa: E731
    head = timing_head(22)
    t, g, m = result["train"], result["generate"], result["many"]
    lines = [f"eqrope adapters benchmark ({result['mode']}), {result['machine']['cpu_model']}, "
             f"{result['machine']['cpu_count']} CPUs, jax {result['machine']['jax']}",
             "", f"train: batch {t['batch']} x {t['seq']} tokens, rank {t['rank']} on {', '.join(t['targets'])}: "
             f"{t['adapter_params']:,} adapter params of {t['model_params']:,}", head]
    lines += [row(k, v) for k, v in t["timings"].items()]
    lines += [f"  optimizer state: full {t['optimizer_state_nbytes']['full']:,} B, adapter "
              f"{t['optimizer_state_nbytes']['adapter']:,} B",
              "", f"generate: {g['rows']} rows, prompt {g['prompt']}, {g['max_new']} new tokens; "
              f"identical tokens: {g['identical_tokens']}", head]
    lines += [row(k, v) for k, v in g["timings"].items()]
    lines += ["", f"many: {m['rows']} rows, {m['adapters']} adapters; each row equals its adapter's own "
              f"run: {all(m['rows_equal_own_adapter'])}", head]
    lines += [row(k, v) for k, v in m["timings"].items()]
    lines += ["", "targets:"]
    lines += [f"  {x['name']:<55}{x['target']:>8}{fmt(x['measured']):>9}  {verdict(x['met'])}"
              for x in result["targets"]]
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="shrunk sizes and 1 repeat, for the tests")
    add_output_arguments(parser, "folder for adapters_cpu.json")
    args = parser.parse_args(argv)
    mode = "tiny" if args.tiny else "default"
    cfg = MODES[mode]
    out = args.out if args.out is not None else results_folder(args.save)
    start = time.perf_counter()
    base = eqrope.RotaryDecoder(**cfg["shape"], key=jax.random.key(0))
    result = {"mode": mode, "machine": machine_info(), "config": base.config.to_dict(),
              "sizes": {k: v for k, v in cfg.items() if k != "shape"}}
    for name, fn in (("train", train), ("generate", generation), ("many", many)):
        log(f"[{mode}] {name} ({time.perf_counter() - start:.0f} s)")
        result[name] = fn(base, cfg)
    result["targets"] = targets(result)
    result["wall_s"] = time.perf_counter() - start
    path = write_json(out / "adapters_cpu.json", result)
    print(table(result))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
