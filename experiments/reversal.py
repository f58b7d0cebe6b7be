"""String reversal: does a rotary model reverse strings longer than any it trained on?

The textbook's sections 2.4 and 2.6 and its exercises 2 and 5, with eqrope. Two models of
the chapter's architecture (LayerNorm, GELU MLP, biases, d_model 64, 4 heads, 2 blocks,
max_len 25, vocabulary 12) are trained on strings of some lengths and tested, by exact
match of the greedy answer, on fresh strings of those and other lengths:

- `rotary`: rotary positions (101,644 parameters);
- `learned`: a learned table of 25 positions added at the input (103,244 parameters).

After training, each model also generates from random reversal prompts with and without
the key/value cache, and the two token sequences are compared.

Run from the repository root:

    python experiments/reversal.py                                  # section 2.4 and 2.6
    python experiments/reversal.py --name base100 --models rotary --rope-base 100   # exercise 2
    python experiments/reversal.py --name holdout --train-lengths 3-8,11-12 \\
        --test-lengths 3-8,11-12 9-10                                 # exercise 5

Outputs, in `--out` (default `experiments/results`): `reversal_<name>.json` (everything
measured), `reversal_<name>.md` (the by-length table) and `reversal_<name>.png` (the
figure). Trained models go to `--checkpoints/<name>/<model>_seed<seed>/` (written with
`eqrope.save`); `--load` reads them back and skips training.

Every count comes with a Wilson 95% interval, and every model is also tested on a large
sample (`--large-sample`, 4,000 fresh strings per test set, from another seed), so that a
model's rate can be told from one draw of 500. `--add-large-sample` does only that for an
existing run: it reads `reversal_<name>.json`, tests its saved checkpoints on the large
sample, and rewrites the JSON (keeping every committed count), the table and the figure:

    python experiments/reversal.py --name main --add-large-sample
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
from tqdm import tqdm

import eqrope
import eqrope.testing
import reversal_data as data
from reversal_report import markdown_table, plot, with_interval


MODELS = {"rotary": "rope", "learned": "learned"}
TEST_SEED = 20240  # one fixed test set for every model and seed, so results pair up
LARGE_SAMPLE_SEED = 20241  # the large sample: another draw, shared the same way
ROOT = Path(__file__).resolve().parent.parent


def repo_command(argv: list[str] | None = None) -> str:
    """The command line (`sys.argv` by default) as `python <args>`, with every absolute
    path inside the repository written relative to its root, so that a results file does
    not record the machine it ran on."""
    return " ".join(["python", *map(_relative, sys.argv if argv is None else argv)])


def _relative(arg: str) -> str:
    path = Path(arg)
    if path.is_absolute():
        try:
            return str(path.resolve().relative_to(ROOT))
        except ValueError:
            pass
    return arg


def build_model(kind: str, rope_base: float, *, key) -> eqrope.RotaryDecoder:
    """The chapter's model: `RotaryDecoder(12, 64, 4, 2, 25)` with LayerNorm, GELU, biases."""
    return eqrope.RotaryDecoder(
        data.VOCAB_SIZE,
        64,
        4,
        2,
        data.MAX_LEN,
        norm="layer",
        mlp="gelu",
        bias=True,
        positions=MODELS[kind],
        rope_base=rope_base,
        key=key,
    )


def make_optimizer(lr: float, warmup: int, steps: int) -> optax.GradientTransformation:
    """AdamW (weight decay 0.01), linear warm-up to `lr`, cosine decay to `lr / 10`, and
    gradients clipped to global norm 1."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=lr,
        warmup_steps=min(warmup, max(steps - 1, 0)),
        decay_steps=max(steps, 1),
        end_value=lr / 10,
    )
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))


def train(model, args, seed: int, label: str):
    """`args.steps` steps of `args.batch` strings drawn from `args.train_lengths`.

    The loss is the cross-entropy on the answer letters only (`data.training_batch`).
    **Returns:** `(model, info)` with the final loss (mean of the last 50 steps) and the
    training time.
    """
    optimizer = make_optimizer(args.lr, args.warmup, args.steps)
    opt_state = eqrope.init_optimizer(optimizer, model)
    train_step = eqrope.make_train_step(optimizer)
    rng = np.random.default_rng(seed)
    recent: list = []
    start = time.perf_counter()
    with tqdm(range(args.steps), desc=label, unit="step", leave=False, mininterval=1.0) as bar:
        for i in bar:
            ids, targets, mask = data.training_batch(rng, args.batch, args.train_lengths)
            model, opt_state, loss = train_step(
                model, opt_state, jnp.asarray(ids), jnp.asarray(targets), jnp.asarray(mask)
            )
            recent = (recent + [loss])[-50:]
            if i % 50 == 49 or i == args.steps - 1:
                bar.set_postfix(loss=f"{float(loss):.4f}")
    seconds = time.perf_counter() - start
    final = float(np.mean([float(x) for x in recent])) if recent else float("nan")
    return model, {"final_loss": final, "train_seconds": round(seconds, 2)}


def make_test_sets(args) -> dict[str, list[np.ndarray]]:
    """`args.n_test` fresh strings for each entry of `--test-lengths`, from `TEST_SEED`."""
    rng = np.random.default_rng(TEST_SEED)
    return {
        spec: data.random_strings(rng, args.n_test, data.parse_lengths(spec))
        for spec in args.test_lengths
    }


def make_large_sample(test_lengths: list[str], n: int) -> dict[str, list[np.ndarray]]:
    """`n` fresh strings for each test set, from `LARGE_SAMPLE_SEED`."""
    rng = np.random.default_rng(LARGE_SAMPLE_SEED)
    return {spec: data.random_strings(rng, n, data.parse_lengths(spec)) for spec in test_lengths}


def exact_matches(model, strings: list[np.ndarray]) -> dict:
    """`{"correct", "total", "by_length": {L: [correct, strings]}}`, for the large sample."""
    ok = data.answers_correct(greedy_answers(model, strings), strings)
    sizes = np.array([len(s) for s in strings])
    return {
        "correct": int(ok.sum()),
        "total": len(strings),
        "by_length": {
            str(n): [int(ok[sizes == n].sum()), int((sizes == n).sum())]
            for n in sorted(set(sizes.tolist()))
        },
    }


def greedy_answers(model, strings: list[np.ndarray]) -> np.ndarray:
    """Greedy tokens for the prompts `string, SEP`, all rows in one cached `generate`."""
    prompt, lengths = data.prompts(strings)
    tokens = eqrope.generate(
        model, jnp.asarray(prompt), data.MAX_STRING, prompt_lengths=jnp.asarray(lengths)
    )
    return np.asarray(tokens)


def evaluate(model, strings: list[np.ndarray]) -> dict:
    """Exact matches, and answer letters right, overall, by length and by answer position.

    **Returns:** a dict with

    - `correct`, `total`: exact-match answers and strings;
    - `by_length`: `{L: [correct, strings]}`;
    - `letter_accuracy`, `letters_by_length` (`{L: [letters right, letters]}`);
    - `by_position`: `{L: {"right": [...], "first_letter": [...]}}`, for each answer
      position `j = 0 .. L-1` (the `j+1`-th letter written after SEP) how many strings
      have it right, and how many have the string's first letter there instead.
    """
    tokens = greedy_answers(model, strings)
    ok = data.answers_correct(tokens, strings)
    sizes = np.array([len(s) for s in strings])
    lengths = sorted(set(sizes.tolist()))
    answers = [tokens[i, len(s) + 1 : 2 * len(s) + 1] for i, s in enumerate(strings)]
    letters = np.array([int(np.sum(a == s[::-1])) for a, s in zip(answers, strings)])

    def by_position(n: int) -> dict:
        rows = [i for i, s in enumerate(strings) if len(s) == n]
        right = np.sum([answers[i] == strings[i][::-1] for i in rows], axis=0)
        first = np.sum([answers[i] == strings[i][0] for i in rows], axis=0)
        return {"right": right.astype(int).tolist(), "first_letter": first.astype(int).tolist()}

    return {
        "correct": int(ok.sum()),
        "total": len(strings),
        "by_length": {str(n): [int(ok[sizes == n].sum()), int((sizes == n).sum())] for n in lengths},
        "letter_accuracy": float(letters.sum() / sizes.sum()),
        "letters_by_length": {
            str(n): [int(letters[sizes == n].sum()), int(sizes[sizes == n].sum())] for n in lengths
        },
        "by_position": {str(n): by_position(n) for n in lengths},
    }


def cache_equality(model, n: int, seed: int) -> list[int]:
    """On `n` random reversal prompts (lengths 3 to 12), greedy generation of 12 tokens
    with the cache and without it. **Returns:** `[identical rows, n]`."""
    if n == 0:
        return [0, 0]
    strings = data.random_strings(np.random.default_rng(seed), n, tuple(range(3, 13)))
    prompt, lengths = data.prompts(strings)
    prompt, lengths = jnp.asarray(prompt), jnp.asarray(lengths)
    cached = eqrope.generate(model, prompt, data.MAX_STRING, prompt_lengths=lengths)
    plain = eqrope.generate(
        eqrope.testing.Uncached(model), prompt, data.MAX_STRING, prompt_lengths=lengths
    )
    same = np.all(np.asarray(cached) == np.asarray(plain), axis=1)
    return [int(same.sum()), n]


def checkpoint_dir(args, kind: str, seed: int) -> Path:
    return args.checkpoints / args.name / f"{kind}_seed{seed}"


def load_or_train(path: Path, load: bool, train_new, hint: str):
    """With `load`, read the checkpoint at `path` and its `train.json`; otherwise call
    `train_new() -> (model, info)` and save both there (`eqrope.save`).

    `hint` says which options must match for `--load` to find the checkpoint.
    **Returns:** `(model, info)`.
    """
    info_file = path / "train.json"
    if load:
        if not info_file.is_file():
            raise FileNotFoundError(
                f"--load: no checkpoint at {path}; run once without --load ({hint}) to "
                "train and save it."
            )
        return eqrope.load(path), json.loads(info_file.read_text())
    model, info = train_new()
    eqrope.save(path, model)
    info_file.write_text(json.dumps(info, indent=2) + "\n")
    return model, info


def trained_model(args, kind: str, seed: int):
    """Train (and save) the model, or with `--load` read it back."""

    def train_new():
        model = build_model(kind, args.rope_base, key=jax.random.PRNGKey(seed))
        model, info = train(model, args, seed, f"{kind} seed {seed}")
        info.update(steps=args.steps, batch=args.batch, lr=args.lr, train_lengths=list(args.train_lengths))
        return model, info

    path = checkpoint_dir(args, kind, seed)
    model, info = load_or_train(
        path, args.load, train_new, "same --name, --checkpoints, --models and --seeds"
    )
    if args.load and model.config.rope_base != args.rope_base and kind == "rotary":
        raise ValueError(
            f"--load: {path} has rope_base {model.config.rope_base}, but --rope-base is "
            f"{args.rope_base}; pass the same --rope-base or another --name."
        )
    return model, info


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", default="main", help="name of this experiment (file names)")
    p.add_argument("--models", nargs="+", default=["rotary", "learned"], choices=list(MODELS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                   help="training seeds (model init and training data)")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate")
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--rope-base", type=float, default=10000.0)
    p.add_argument("--train-lengths", default="3-8", help="e.g. 3-8 or 3-8,11-12")
    p.add_argument("--test-lengths", nargs="+", default=["3-8", "9-12"],
                   help="one test set of --n-test strings per entry")
    p.add_argument("--n-test", type=int, default=500)
    p.add_argument("--cache-prompts", type=int, default=200,
                   help="prompts for the cache-equality check (0 skips it)")
    p.add_argument("--out", type=Path, default=Path("experiments/results"))
    p.add_argument("--checkpoints", type=Path, default=Path("experiments/checkpoints"))
    p.add_argument("--load", action="store_true", help="load saved models, skip training")
    p.add_argument("--large-sample", type=int, default=4000,
                   help="also test every model on this many fresh strings per test set (0: no)")
    p.add_argument("--add-large-sample", action="store_true",
                   help="only add the large sample to an existing reversal_<name>.json "
                        "(its saved checkpoints are tested; nothing is retrained)")
    args = p.parse_args(argv)
    for name in ("steps", "batch", "n_test"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.cache_prompts < 0 or args.large_sample < 0:
        p.error("--cache-prompts and --large-sample must be >= 0")
    if args.add_large_sample and args.large_sample == 0:
        p.error("--add-large-sample needs --large-sample > 0")
    try:
        args.train_lengths_text = args.train_lengths
        args.train_lengths = data.parse_lengths(args.train_lengths)
        for spec in args.test_lengths:
            data.parse_lengths(spec)
    except ValueError as e:
        p.error(str(e))
    return args


def add_large_sample(args) -> dict:
    """Test the checkpoints of an existing `reversal_<name>.json` on the large sample and
    rewrite its JSON (every earlier count kept; the command made repository-relative), its
    table and its figure."""
    stem = args.out / f"reversal_{args.name}"
    result = json.loads(stem.with_suffix(".json").read_text())
    result["command"] = " ".join(map(_relative, result["command"].split(" ")))
    settings = result["settings"]
    start = time.perf_counter()
    samples = make_large_sample(settings["test_lengths"], args.large_sample)
    for kind, runs in result["runs"].items():
        for run in runs:
            model = eqrope.load(checkpoint_dir(args, kind, run["seed"]))
            run["large_sample"] = {spec: exact_matches(model, s) for spec, s in samples.items()}
            print(f"{kind} seed {run['seed']}: " + ", ".join(
                f"{spec}: {with_interval(t['correct'], t['total'])}"
                for spec, t in run["large_sample"].items()
            ), flush=True)
    settings["large_sample"] = {"n": args.large_sample, "seed": LARGE_SAMPLE_SEED}
    result["large_sample_command"] = repo_command()
    result["large_sample_seconds"] = round(time.perf_counter() - start, 1)
    write_outputs(result, stem)
    return result


def write_outputs(result: dict, stem: Path) -> str:
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    table = markdown_table(result)
    stem.with_suffix(".md").write_text(table)
    plot(result, stem.with_suffix(".png"))
    return table


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.add_large_sample:
        return add_large_sample(args)
    start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    tests = make_test_sets(args)
    samples = make_large_sample(args.test_lengths, args.large_sample) if args.large_sample else {}
    settings = {
        "models": args.models,
        "seeds": args.seeds,
        "steps": args.steps,
        "batch": args.batch,
        "optimizer": "clip_by_global_norm(1.0) + adamw(weight_decay=0.01)",
        "lr": args.lr,
        "schedule": f"linear warm-up over {args.warmup} steps to lr, cosine decay to lr/10",
        "rope_base": args.rope_base,
        "train_lengths": list(args.train_lengths),
        "train_lengths_text": args.train_lengths_text,
        "test_lengths": args.test_lengths,
        "n_test": args.n_test,
        "test_seed": TEST_SEED,
        "cache_prompts": args.cache_prompts,
        "vocab": {"letters": "ids 0-9 (a-j)", "SEP": data.SEP, "PAD": data.PAD},
        "loaded": args.load,
    }
    if samples:
        settings["large_sample"] = {"n": args.large_sample, "seed": LARGE_SAMPLE_SEED}
    result = {"name": args.name, "command": repo_command(), "settings": settings, "runs": {}}
    for kind in args.models:
        result["runs"][kind] = []
        for seed in args.seeds:
            model, info = trained_model(args, kind, seed)
            run = {"seed": seed, "params": eqrope.count_params(model), **info, "tests": {}}
            for spec, strings in tests.items():
                run["tests"][spec] = evaluate(model, strings)
            if samples:
                run["large_sample"] = {spec: exact_matches(model, s) for spec, s in samples.items()}
            run["cache_equal"] = cache_equality(model, args.cache_prompts, seed=10_000 + seed)
            summary = ", ".join(f"{s}: {t['correct']}/{t['total']}" for s, t in run["tests"].items())
            print(
                f"{kind} seed {seed}: loss {run['final_loss']:.4f}, {summary}, cache "
                f"{run['cache_equal'][0]}/{run['cache_equal'][1]}",
                flush=True,
            )
            result["runs"][kind].append(run)
    result["wall_seconds"] = round(time.perf_counter() - start, 1)
    table = write_outputs(result, args.out / f"reversal_{args.name}")
    print(table)
    print(f"wrote {args.out / f'reversal_{args.name}'}.json, .md, .png in {result['wall_seconds']} s")
    return result


if __name__ == "__main__":
    main()
