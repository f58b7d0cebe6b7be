"""GRPO on reversal: can reinforcement learning on the model's own samples do what a
supervised fine-tune did, at equal compute?

The chapter's rotary reversal models (`experiments/checkpoints/main/rotary_seed<s>`,
trained on lengths 3-8) fail on lengths 9-12. A supervised fine-tune on lengths 3-12
brought them to 60-72 % (docs/textbook.md, "Reversal, after a short fine-tune"). Here each
model is trained two ways from the same checkpoint, with the same budget of tokens
processed (every text position through the model, in the rollout, the reference and the
updates for GRPO, in the training batches for the fine-tune):

- `grpo`: `eqrope.make_grpo_step` on prompts `string, SEP` of lengths 3-12, `--group`
  samples each at temperature 1, rewarded by the fraction of answer positions reversed
  correctly (a jittable reward: each step is one compiled program);
- `sft`: `extrapolation.finetune` (no rope scaling), the fine-tune of the textbook, for as
  many steps as the budget allows.

Exact match (greedy) on lengths 9-12 and 13-16, before and after, with Wilson intervals,
over 3 seeds. Run from the repository root:

    python experiments/grpo.py            # writes experiments/results/grpo.{json,md,png}
    python experiments/grpo.py --load     # re-renders the table and figure from the JSON
"""

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import eqrope
import extrapolation
import reversal
import reversal_data as data


TRAIN_LENGTHS = tuple(range(3, 13))
PROMPT_WIDTH = data.MAX_STRING + 1  # every prompt padded to 13 tokens: one program
GRPO_SEED = 17_000
RANGES = {"3-8": range(3, 9), "9-12": range(9, 13), "13-16": range(13, 17)}


def reversal_reward(tokens, prompt_lengths, ends):
    """The fraction of the `L` answer positions that hold the reversed string (jittable).

    `tokens` `(batch, group, total)` hold `string, SEP, answer...`; the prompt's length is
    `L + 1`. Answer position `k < L` sits at `L + 1 + k` and should equal the string's
    letter `L - 1 - k`."""
    total = tokens.shape[-1]
    n = prompt_lengths - 1  # the string's length L
    k = jnp.arange(data.MAX_STRING)
    want = jnp.clip(n[:, None] - 1 - k[None, :], 0, total - 1)  # (batch, k)
    at = jnp.clip(prompt_lengths[:, None] + k[None, :], 0, total - 1)
    answer = jnp.take_along_axis(tokens, jnp.broadcast_to(at[:, None, :], tokens.shape[:2] + at.shape[-1:]), -1)
    letters = jnp.take_along_axis(tokens[:, 0, :], want, -1)[:, None, :]
    counted = (k[None, :] < n[:, None])[:, None, :]
    right = jnp.sum((answer == letters) & counted, axis=-1)
    return (right / n[:, None]).astype(jnp.float32)


def grpo_prompts(rng: np.random.Generator, batch: int) -> tuple[np.ndarray, np.ndarray]:
    strings = data.random_strings(rng, batch, TRAIN_LENGTHS)
    prompt, lengths = data.prompts(strings)
    out = np.full((batch, PROMPT_WIDTH), data.PAD, np.int32)
    out[:, : prompt.shape[1]] = prompt
    return out, lengths


def run_grpo(model, seed: int, args) -> tuple:
    """GRPO from `model` until the token budget is spent. **Returns:** `(model, info)`."""
    rows = args.batch * args.group
    width = PROMPT_WIDTH + data.MAX_STRING  # = data.MAX_LEN, the text of each sample
    passes = 1 + args.updates + (1 if args.beta > 0 else 0)
    steps = max(1, args.budget // (rows * width * passes))
    optimizer = reversal.make_optimizer(args.lr, args.warmup, steps)
    step = eqrope.make_grpo_step(
        optimizer, reversal_reward, group_size=args.group, max_new=data.MAX_STRING,
        temperature=1.0, beta=args.beta, updates=args.updates, pad_id=data.PAD,
    )
    state = eqrope.init_optimizer(optimizer, model)
    reference = model
    rng = np.random.default_rng([GRPO_SEED, seed])
    curve, start = [], time.perf_counter()
    for i in range(steps):
        prompt, lengths = grpo_prompts(rng, args.batch)
        model, state, m = step(model, state, prompt, key=jax.random.key(1000 * seed + i),
                               prompt_lengths=lengths, reference=reference)
        curve.append({k: round(float(v), 6) for k, v in m.items()})
    info = {"steps": steps, "tokens": steps * rows * width * passes,
            "train_seconds": round(time.perf_counter() - start, 2), "curve": curve}
    return model, info


def run_sft(model, seed: int, args) -> tuple:
    steps = max(1, args.budget // (args.sft_batch * data.MAX_LEN))
    ns = argparse.Namespace(finetune_lr=args.sft_lr, finetune_warmup=min(40, steps // 10),
                            finetune_steps=steps, finetune_batch=args.sft_batch)
    model, info = extrapolation.finetune(model, "none", 1.0, seed, ns)
    info["tokens"] = steps * args.sft_batch * data.MAX_LEN
    return model, info


def exact(model, strings: dict) -> dict[int, int]:
    return extrapolation.reversal_counts(model, "none", 1.0, strings, model.config.rope_base)


def pooled(counts: list[dict], lengths, n: int) -> tuple[int, int]:
    return sum(c[str(L)] for c in counts for L in lengths), n * len(lengths) * len(counts)


def render(record: dict) -> str:
    n = record["settings"]["n_per_length"]
    lines = [
        "| arm | tokens / seed | " + " | ".join(f"{r}: mean (per seed) | {r}: all seeds (Wilson 95%)" for r in RANGES) + " |",
        "|---|---|" + "---|---|" * len(RANGES),
    ]
    for arm in ("before", "grpo", "sft"):
        runs = [record["runs"][str(s)] for s in record["settings"]["seeds"]]
        counts = [r[arm]["counts"] for r in runs]
        tokens = "0" if arm == "before" else f"{runs[0][arm]['tokens']:,}"
        cells = []
        for name, lengths in RANGES.items():
            lengths = [L for L in lengths if str(L) in counts[0]]
            if not lengths:
                cells += ["–", "–"]
                continue
            per = [100 * sum(c[str(L)] for L in lengths) / (n * len(lengths)) for c in counts]
            k, total = pooled(counts, lengths, n)
            cells += [f"{np.mean(per):.1f} ({', '.join(f'{p:.1f}' for p in per)})",
                      reversal.with_interval(k, total)]
        lines.append(f"| {arm} | {tokens} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.6))
    n = record["settings"]["n_per_length"]
    for s in record["settings"]["seeds"]:
        run = record["runs"][str(s)]
        curve = [c["reward_mean"] for c in run["grpo"]["info"]["curve"]]
        ax.plot(np.arange(1, len(curve) + 1) * run["grpo"]["tokens"] / len(curve), curve, label=f"seed {s}")
    ax.set_xlabel("tokens processed")
    ax.set_ylabel("mean reward (fraction of answer right)")
    ax.set_title("GRPO reward, lengths 3-12")
    ax.legend()
    lengths = sorted({int(L) for r in record["runs"].values() for L in r["before"]["counts"]})
    for arm, style in (("before", ":"), ("grpo", "-"), ("sft", "--")):
        rates = np.mean([[record["runs"][str(s)][arm]["counts"][str(L)] / n for L in lengths]
                         for s in record["settings"]["seeds"]], axis=0)
        bx.plot(lengths, 100 * rates, style, marker="o", label=arm)
    bx.axvspan(8.5, max(lengths) + 0.5, color="0.9")
    bx.set_xlabel("string length")
    bx.set_ylabel("exact match, mean of seeds (%)")
    bx.set_title("Before and after, equal tokens")
    bx.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--lengths", default="3-16", help="test lengths (at most 16)")
    p.add_argument("--n-per-length", type=int, default=250)
    p.add_argument("--budget", type=int, default=400 * 64 * data.MAX_LEN,
                   help="tokens processed per arm and seed (default: the textbook's fine-tune)")
    p.add_argument("--batch", type=int, default=16, help="GRPO prompts per step")
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--updates", type=int, default=1)
    p.add_argument("--beta", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--sft-batch", type=int, default=64)
    p.add_argument("--sft-lr", type=float, default=1e-3)
    p.add_argument("--source", type=Path, default=Path("experiments/checkpoints/main"))
    p.add_argument("--out", type=Path, default=Path("experiments/results"))
    p.add_argument("--name", default="grpo")
    p.add_argument("--load", action="store_true", help="re-render the table and figure from the JSON")
    args = p.parse_args(argv)
    low, _, high = args.lengths.partition("-")
    args.lengths = tuple(range(int(low), int(high or low) + 1))
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / args.name
    if args.load:
        record = json.loads(stem.with_suffix(".json").read_text())
    else:
        start = time.perf_counter()
        runs = {}
        for seed in args.seeds:
            source = eqrope.load(args.source / f"rotary_seed{seed}", layout="stacked")  # trained below
            strings = extrapolation.test_strings(seed, args.lengths, args.n_per_length)
            run = {"before": {"counts": exact(source, strings)}}
            for arm, train in (("grpo", run_grpo), ("sft", run_sft)):
                tuned, info = train(source, seed, args)
                run[arm] = {"counts": exact(tuned, strings), "tokens": info["tokens"], "info": info}
                print(f"seed {seed} {arm}: {info['tokens']:,} tokens, {info['train_seconds']} s, "
                      f"9-12 right {sum(run[arm]['counts'][L] for L in range(9, 13) if L in args.lengths)}",
                      flush=True)
            runs[str(seed)] = {arm: {**v, "counts": {str(k): c for k, c in v["counts"].items()}}
                               for arm, v in run.items()}
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        settings.update(train_lengths=list(TRAIN_LENGTHS), grpo_seed=GRPO_SEED, eval_seed=extrapolation.EVAL_SEED)
        record = {"command": reversal.repo_command(), "settings": settings, "runs": runs,
                  "wall_seconds": round(time.perf_counter() - start, 1)}
        stem.with_suffix(".json").write_text(json.dumps(record, indent=1))
    table = render(record)
    stem.with_suffix(".md").write_text(table)
    plot(record, stem.with_suffix(".png"))
    print(table)
    return record


if __name__ == "__main__":
    sys.exit(main() and 0)
