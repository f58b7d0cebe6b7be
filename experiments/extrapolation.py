"""Beyond the chapter: scaling the rotation rates after training.

The textbook's section 2.4 ends with a sentence it does not test: on natural text rotary
models "do extrapolate somewhat, and there are tricks (scaling the rotation rates after
training) that stretch them further". This script tests it with the chapter's own models.

Three arms, each running rotary models under several ropes (`METHODS`, `FINETUNE_METHODS`,
`MARKOV_METHODS`):

1. **reversal** (no retraining): the committed rotary checkpoints of `reversal.py`
   (`experiments/checkpoints/main/rotary_seed{0,1,2}`, trained on strings of 3 to 8
   letters) reverse `--n-per-length` fresh strings of each length 3 to 16, greedy, with
   the cache (`eqrope.generate`), under each rope.
2. **finetune**: the same checkpoints fine-tuned for `--finetune-steps` steps on lengths
   3 to 12 with each rope of `--finetune-methods` (as in the position-interpolation
   paper, Chen et al. 2023, section 3.1), then the same test.
3. **markov**: a task whose useful distances are short (`extrapolation_markov.py`, an
   order-2 Markov language over 16 tokens): a rotary and a learned-position model of the
   chapter's architecture, 3 seeds each, trained on sequences of 32 tokens; per-token loss
   at every position out to 128 (4x), under each rope.

The ropes (`with_rope`): `none` (the trained rates); `linear` (position interpolation:
every rate divided by the factor); `ntk` (the static NTK-aware base change,
`rope_base * factor ** (d / (d - 2))`, `d` the head dimension); `dynamic` (NTK-aware with
the base set for the length of the sequence at hand, as transformers' dynamic scaling
computes it for a sequence run in one pass); `yarn` (Peng et al. 2023, with its attention
factor); `llama3` (Meta's Llama 3.1 rule). `original_max_len`, the length the scalings
stretch from, is the longest training sequence: 17 tokens for reversal (8 letters, SEP, 8
letters), 32 for the Markov task.

Run from the repository root:

    python experiments/extrapolation.py           # everything: train, evaluate, write
    python experiments/extrapolation.py --load    # re-evaluate the committed checkpoints

On this project's 2-core machine, shared with other jobs (load average 5 to 9), the full
run took 2,229 s: 454 s for the reversal arm, 889 s for the fine-tunes (400 steps each, 18
runs) and 886 s for the Markov task (6 models of 1,000 steps). Most of the reversal arm is
compiling: each rope is a new static config, and `dynamic` compiles once per test length.
`--load` took 703 s and gave back the same `"results"`, record for record.

Outputs, in `--out` (default `experiments/results`): `extrapolation.json` (a top-level
`"results"` list of records `{task, method, factor, finetune, seed, length, correct,
total}` for reversal and `{task, method, factor, finetune, seed, position, loss, total}`
for the Markov task), `extrapolation.md` (the tables), `extrapolation.png` (reversal, in
the style of Figure 2.2) and `extrapolation_markov.png` (loss against position). New
models go to `--checkpoints/extrapolation/` (`eqrope.save`, with a `train.json`); `--load`
reads them back and must reproduce `"results"` exactly.
"""

import argparse
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

import eqrope
import extrapolation_markov as markov
import extrapolation_report as report
import reversal
import reversal_data as data
from extrapolation_ropes import KINDS, parse_methods, with_rope


# (method, factor): "none" first, then every kind at each factor.
METHODS = [("none", 1.0)] + [(k, f) for k in KINDS for f in (1.5, 2.0)]
MARKOV_METHODS = [("none", 1.0)] + [(k, f) for k in KINDS for f in (2.0, 4.0)]
FINETUNE_METHODS = [("none", 1.0)] + [(k, 2.0) for k in KINDS]

REVERSAL_ORIGINAL = 2 * 8 + 1  # the longest training sequence: 8 letters, SEP, 8 letters
FINETUNE_LENGTHS = tuple(range(3, 13))
EVAL_SEED = 16_000  # the test strings of seed s come from default_rng([EVAL_SEED, s])
FINETUNE_SEED = 16_001
MARKOV_TRAIN_LEN = 32
MARKOV_EVAL_LEN = 4 * MARKOV_TRAIN_LEN
MARKOV_EVAL_SEED = 16_002


# -- reversal -------------------------------------------------------------------------------


def test_strings(seed: int, lengths: tuple[int, ...], n: int) -> dict[int, list[np.ndarray]]:
    """`n` fresh strings of each length for model seed `seed` (shared by every method)."""
    rng = np.random.default_rng([EVAL_SEED, seed])
    return {length: data.random_strings(rng, n, (length,)) for length in lengths}


def reversal_counts(model, method: str, factor: float, strings: dict, base: float) -> dict[int, int]:
    """Exact-match answers per length, greedy with the cache, under one rope.

    One batched `generate` for all lengths, with `max_len` the longest test sequence;
    `dynamic` instead runs each length on its own, with the base for that length's whole
    sequence (`2L + 1` tokens, at least `REVERSAL_ORIGINAL`, below which it changes
    nothing).
    """
    longest = max(2 * max(strings) + 1, REVERSAL_ORIGINAL)
    groups: dict[int, list[int]] = {}
    for length in strings:
        max_len = max(2 * length + 1, REVERSAL_ORIGINAL) if method == "dynamic" else longest
        groups.setdefault(max_len, []).append(length)
    counts = {}
    for max_len, lengths in groups.items():
        scaled = with_rope(model, method, factor, base=base,
                           original_max_len=REVERSAL_ORIGINAL, max_len=max_len)
        rows = [s for length in lengths for s in strings[length]]
        prompt, prompt_lengths = data.prompts(rows)
        tokens = eqrope.generate(scaled, jnp.asarray(prompt), max(lengths),
                                 prompt_lengths=jnp.asarray(prompt_lengths))
        ok = data.answers_correct(np.asarray(tokens), rows)
        sizes = np.array([len(s) for s in rows])
        counts.update({length: int(ok[sizes == length].sum()) for length in lengths})
    return counts


def finetune(model, method: str, factor: float, seed: int, args) -> tuple:
    """`args.finetune_steps` steps on lengths 3-12 under one rope, from a trained model.

    Training rows are padded to `data.MAX_LEN` (25) tokens, so `dynamic` trains with the
    base for a 25-token sequence, as transformers would for such a batch. The optimiser is
    `reversal.make_optimizer` with a fresh state. **Returns:** `(model, info)`; the model
    keeps the rope it was trained with (in its config) and `max_len` 25.
    """
    model = with_rope(model, method, factor, base=model.config.rope_base,
                      original_max_len=REVERSAL_ORIGINAL, max_len=data.MAX_LEN)
    optimizer = reversal.make_optimizer(args.finetune_lr, args.finetune_warmup, args.finetune_steps)
    opt_state = eqrope.init_optimizer(optimizer, model)
    step = eqrope.make_train_step(optimizer)
    rng = np.random.default_rng([FINETUNE_SEED, seed])
    losses = []
    start = time.perf_counter()
    for _ in tqdm(range(args.finetune_steps), desc=f"finetune {method} {factor} seed {seed}",
                  leave=False, mininterval=1.0):
        ids, targets, mask = data.training_batch(rng, args.finetune_batch, FINETUNE_LENGTHS)
        model, opt_state, loss = step(model, opt_state, jnp.asarray(ids), jnp.asarray(targets),
                                      jnp.asarray(mask))
        losses.append(loss)
    final = float(np.mean([float(x) for x in losses[-50:]]))
    info = {"final_loss": final, "train_seconds": round(time.perf_counter() - start, 2),
            "steps": args.finetune_steps, "batch": args.finetune_batch, "lr": args.finetune_lr,
            "train_lengths": list(FINETUNE_LENGTHS)}
    return model, info


# -- the Markov task ------------------------------------------------------------------------


def markov_model(kind: str, *, key) -> eqrope.RotaryDecoder:
    """The chapter's architecture (LayerNorm, GELU, biases, 64 wide, 4 heads, 2 blocks)
    for 16 tokens and `MARKOV_EVAL_LEN` positions (a learned table of 128 rows, of which
    training reaches the first 32)."""
    return eqrope.RotaryDecoder(
        markov.VOCAB_SIZE, 64, 4, 2, MARKOV_EVAL_LEN, norm="layer", mlp="gelu", bias=True,
        positions=reversal.MODELS[kind], key=key,
    )


def markov_train(kind: str, seed: int, chain, args) -> tuple:
    model = markov_model(kind, key=jax.random.PRNGKey(seed))
    optimizer = reversal.make_optimizer(args.markov_lr, args.markov_warmup, args.markov_steps)
    opt_state = eqrope.init_optimizer(optimizer, model)
    step = eqrope.make_train_step(optimizer)
    rng = np.random.default_rng(seed)
    losses = []
    start = time.perf_counter()
    for _ in tqdm(range(args.markov_steps), desc=f"markov {kind} seed {seed}", leave=False,
                  mininterval=1.0):
        x = markov.sample(chain, rng, args.markov_batch, MARKOV_TRAIN_LEN + 1)
        model, opt_state, loss = step(model, opt_state, jnp.asarray(x[:, :-1]), jnp.asarray(x[:, 1:]))
        losses.append(loss)
    final = float(np.mean([float(x) for x in losses[-50:]]))
    info = {"final_loss": final, "train_seconds": round(time.perf_counter() - start, 2),
            "steps": args.markov_steps, "batch": args.markov_batch, "lr": args.markov_lr,
            "train_len": MARKOV_TRAIN_LEN}
    return model, info


@eqx.filter_jit
def loss_by_position(model, ids, targets):
    """Mean next-token loss (nats) at each position over the rows, float32."""
    logits = jax.vmap(model)(ids).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0].mean(axis=0)


def saved_or_trained(args, name: str, train_new):
    """`reversal.load_or_train` under `--checkpoints/extrapolation/<name>`."""
    return reversal.load_or_train(
        args.checkpoints / "extrapolation" / name, args.load, train_new,
        "same --checkpoints, seeds and methods",
    )


def method_name(method: str, factor: float) -> str:
    return method if method == "none" else f"{method}{factor:g}"


# -- the arms -------------------------------------------------------------------------------


def run_reversal(args, sources: dict, results: list, models: dict, seconds: dict) -> None:
    """The reversal arm (`args.methods`) and the fine-tune arm (`args.finetune_methods`),
    seed by seed; `seconds` gets the time of each (the fine-tune arm's includes its test)."""
    seconds.setdefault("reversal", 0.0)
    for seed, model in sources.items():
        strings = test_strings(seed, args.lengths, args.n_per_length)
        base = model.config.rope_base
        t0 = time.perf_counter()
        for method, factor in args.methods:
            counts = reversal_counts(model, method, factor, strings, base)
            results += reversal_records(method, factor, False, seed, counts, args.n_per_length)
            print(f"reversal {method_name(method, factor)} seed {seed}: "
                  + report.summary(counts, args.n_per_length), flush=True)
        seconds["reversal"] = round(seconds["reversal"] + time.perf_counter() - t0, 1)
        if "finetune" in args.arms:
            t0 = time.perf_counter()
            for method, factor in args.finetune_methods:
                name = f"reversal_{method_name(method, factor)}_seed{seed}"
                tuned, info = saved_or_trained(
                    args, name, lambda: finetune(model, method, factor, seed, args)
                )
                models[name] = info
                counts = reversal_counts(tuned, method, factor, strings, base)
                results += reversal_records(method, factor, True, seed, counts, args.n_per_length)
                print(f"reversal fine-tuned {method_name(method, factor)} seed {seed}: loss "
                      f"{info['final_loss']:.4f}, " + report.summary(counts, args.n_per_length),
                      flush=True)
            seconds["finetune"] = round(seconds.get("finetune", 0.0) + time.perf_counter() - t0, 1)


def reversal_records(method, factor, finetune_, seed, counts, total) -> list[dict]:
    return [
        {"task": "reversal", "method": method, "factor": factor, "finetune": finetune_,
         "seed": seed, "length": length, "correct": correct, "total": total}
        for length, correct in sorted(counts.items())
    ]


def run_markov(args, results: list, models: dict) -> dict:
    chain = markov.make_chain()
    x = markov.sample(chain, np.random.default_rng(MARKOV_EVAL_SEED), args.markov_eval,
                      MARKOV_EVAL_LEN + 1)
    ids, targets = jnp.asarray(x[:, :-1]), jnp.asarray(x[:, 1:])
    for kind in ("learned", "rotary"):
        for seed in args.seeds:
            name = f"markov_{kind}_seed{seed}"
            model, info = saved_or_trained(args, name, lambda: markov_train(kind, seed, chain, args))
            models[name] = info
            ropes = [("learned", 1.0)] if kind == "learned" else args.markov_methods
            for method, factor in ropes:
                scaled = model if kind == "learned" else with_rope(
                    model, method, factor, base=model.config.rope_base,
                    original_max_len=MARKOV_TRAIN_LEN, max_len=MARKOV_EVAL_LEN,
                )
                loss = np.asarray(loss_by_position(scaled, ids, targets), np.float64)
                results += [
                    {"task": "markov", "method": method, "factor": factor, "finetune": False,
                     "seed": seed, "position": p, "loss": round(float(v), 4), "total": len(x)}
                    for p, v in enumerate(loss)
                ]
                print(f"markov {kind} {method_name(method, factor)} seed {seed}: loss by "
                      f"quarter {report.quarters(loss)}", flush=True)
    return {
        "entropy_rate": markov.entropy_rate(chain),
        "floor_by_position": [round(float(v), 4) for v in markov.floor_by_position(chain, 2)],
    }


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", nargs="+", default=["reversal", "finetune", "markov"],
                   choices=["reversal", "finetune", "markov"])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--lengths", default="3-16", help="test lengths (at most 16)")
    p.add_argument("--n-per-length", type=int, default=500)
    p.add_argument("--methods", nargs="+", default=[f"{m}:{f:g}" for m, f in METHODS],
                   help="ropes for reversal, as method:factor (none, linear, ntk, dynamic, yarn, llama3)")
    p.add_argument("--finetune-methods", nargs="+",
                   default=[f"{m}:{f:g}" for m, f in FINETUNE_METHODS])
    p.add_argument("--finetune-steps", type=int, default=400)
    p.add_argument("--finetune-batch", type=int, default=64)
    p.add_argument("--finetune-lr", type=float, default=1e-3)
    p.add_argument("--finetune-warmup", type=int, default=40)
    p.add_argument("--markov-methods", nargs="+", default=[f"{m}:{f:g}" for m, f in MARKOV_METHODS])
    p.add_argument("--markov-steps", type=int, default=1000)
    p.add_argument("--markov-batch", type=int, default=64)
    p.add_argument("--markov-lr", type=float, default=3e-3)
    p.add_argument("--markov-warmup", type=int, default=100)
    p.add_argument("--markov-eval", type=int, default=512, help="evaluation sequences")
    p.add_argument("--source", type=Path, default=Path("experiments/checkpoints/main"),
                   help="the chapter's checkpoints (rotary_seed<s> inside)")
    p.add_argument("--out", type=Path, default=Path("experiments/results"))
    p.add_argument("--checkpoints", type=Path, default=Path("experiments/checkpoints"))
    p.add_argument("--load", action="store_true", help="load saved models, skip training")
    args = p.parse_args(argv)
    try:
        lengths = []
        for part in args.lengths.split(","):
            low, _, high = part.partition("-")
            lengths += range(int(low), int(high or low) + 1)
        args.lengths = tuple(sorted(set(lengths)))
        args.methods = parse_methods(args.methods)
        args.finetune_methods = parse_methods(args.finetune_methods)
        args.markov_methods = parse_methods(args.markov_methods)
    except ValueError as e:
        p.error(str(e))
    if not args.lengths or not 1 <= min(args.lengths) <= max(args.lengths) <= 16:
        p.error(f"--lengths must lie in 1-16, got {args.lengths}")
    for name in ("n_per_length", "finetune_steps", "finetune_batch", "markov_steps",
                 "markov_batch", "markov_eval"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    models: dict[str, dict] = {}
    seconds: dict[str, float] = {}
    settings = {
        "arms": args.arms, "seeds": args.seeds, "lengths": list(args.lengths),
        "n_per_length": args.n_per_length, "eval_seed": EVAL_SEED,
        "methods": [list(m) for m in args.methods],
        "reversal_original_max_len": REVERSAL_ORIGINAL,
        "source": str(args.source),
        "finetune": {
            "methods": [list(m) for m in args.finetune_methods], "steps": args.finetune_steps,
            "batch": args.finetune_batch, "lr": args.finetune_lr, "warmup": args.finetune_warmup,
            "lengths": list(FINETUNE_LENGTHS), "seed": FINETUNE_SEED,
            "optimizer": "reversal.make_optimizer: clip 1.0, adamw(weight_decay=0.01), "
                         "linear warm-up, cosine decay to lr/10; fresh state",
        },
        "markov": {
            "methods": [list(m) for m in args.markov_methods], "steps": args.markov_steps,
            "batch": args.markov_batch, "lr": args.markov_lr, "warmup": args.markov_warmup,
            "train_len": MARKOV_TRAIN_LEN, "eval_len": MARKOV_EVAL_LEN,
            "eval_sequences": args.markov_eval, "eval_seed": MARKOV_EVAL_SEED,
            "vocab": markov.VOCAB_SIZE, "order": markov.ORDER,
            "concentration": markov.CONCENTRATION, "chain_seed": markov.CHAIN_SEED,
        },
        "loaded": args.load,
    }
    if "reversal" in args.arms or "finetune" in args.arms:
        # Stacked: the fine-tuning arm trains them (a scan over blocks, as they were trained).
        sources = {s: eqrope.load(args.source / f"rotary_seed{s}", layout="stacked") for s in args.seeds}
        if "reversal" not in args.arms:
            args.methods = []
        run_reversal(args, sources, results, models, seconds)
    if "markov" in args.arms:
        t0 = time.perf_counter()
        settings["markov"].update(run_markov(args, results, models))
        seconds["markov"] = round(time.perf_counter() - t0, 1)
    record = {
        "command": reversal.repo_command(),
        "settings": settings,
        "models": models,
        "seconds": seconds,
        "wall_seconds": round(time.perf_counter() - start, 1),
        "results": results,
    }
    path = args.out / "extrapolation.json"
    path.write_text(report.dumps(record))
    tables = report.markdown(record)
    (args.out / "extrapolation.md").write_text(tables)
    report.plot_reversal(record, args.out / "extrapolation.png")
    report.plot_markov(record, args.out / "extrapolation_markov.png")
    print(tables)
    print(f"wrote {path} and .md, .png in {record['wall_seconds']} s")
    return record


if __name__ == "__main__":
    main()
