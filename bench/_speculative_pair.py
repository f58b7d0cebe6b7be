"""The trained target/draft pair of bench/speculative.py, on `_speculative_task.py`'s task.

The target is the growth size, `RotaryDecoder(29, 256, 4, 4, 256)` (SwiGLU, d_ff 1024: 4.2 M parameters, 16.8 MB in float32); the draft one block of width
64 (69 k parameters, 0.28 MB). They train with `eqrope.make_train_step` (AdamW) on rows
of 128 characters: the target on a mix of the two tasks, half of the rows copying rows
(after 300 steps of copying rows only), the draft on the language only. A copying row's
loss is on the copy alone: with the language's loss on the whole row, the target learned
to predict the copy as language and did not copy. They are saved with `eqrope.save` in
`bench/checkpoints/speculative/{target,draft}`, with `train.json` (settings, losses,
time and `evaluate`'s held-out figures):

    python bench/speculative.py --train     # retrain both: about 11 minutes on 2 cores
"""

import json
import pathlib
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import eqrope
from _speculative_task import (
    ALPHABET, COPY_FRACTION, GRAMMAR_SEED, MAX_LEN, SEP, SPACE, TRAIN_LEN, VOCAB_SIZE, copy_text,
    encode, entropy_per_char, make_grammar, text, training_batch,
)  # fmt: skip


CHECKPOINTS = pathlib.Path(__file__).resolve().parent / "checkpoints" / "speculative"

TARGET_SIZES = dict(d_model=256, n_heads=4, n_blocks=4)
DRAFT_SIZES = dict(d_model=64, n_heads=4, n_blocks=1)
# Steps, batch, peak learning rate and seed of each model's training.
TARGET_TRAINING = dict(steps=900, batch=16, lr=2e-3, seed=0, copy_fraction=COPY_FRACTION,
                       copy_warmup=300)
# One block cannot learn to copy (prompt lookup drafts copies): the draft learns the language.
DRAFT_TRAINING = dict(steps=1500, batch=32, lr=3e-3, seed=1, copy_fraction=0.0)


# -- training -----------------------------------------------------------------------------


def build(sizes: dict, *, key) -> eqrope.RotaryDecoder:
    """`RotaryDecoder(VOCAB_SIZE, d_model, n_heads, n_blocks, MAX_LEN)`, float32."""
    return eqrope.RotaryDecoder(VOCAB_SIZE, sizes["d_model"], sizes["n_heads"],
                                sizes["n_blocks"], MAX_LEN, key=key)


def make_optimizer(lr: float, steps: int) -> optax.GradientTransformation:
    """AdamW (weight decay 0.01), a linear warm-up over 5% of the steps to `lr` and a cosine
    decay to `lr / 10`, gradients clipped to global norm 1."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=lr, warmup_steps=max(steps // 20, 1),
        decay_steps=max(steps, 2), end_value=lr / 10)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))


def train(model, *, steps: int, batch: int, lr: float, seed: int, copy_fraction: float,
          copy_warmup: int = 0, check=None, log=print):
    """`steps` steps of `training_batch(batch, copy_fraction)` from `default_rng(seed)`,
    the first `copy_warmup` of them copying rows only. Every 50 steps a line goes to `log`,
    with `check(model)` (a string) when given.

    **Returns:** `(model, info)`: info holds the settings, the mean loss of the last 50
    steps, the loss every 50 steps, and the seconds spent (checks included).
    """
    grammar = make_grammar()
    optimizer = make_optimizer(lr, steps)
    opt_state = eqrope.init_optimizer(optimizer, model)
    train_step = eqrope.make_train_step(optimizer)
    rng = np.random.default_rng(seed)
    losses = []
    start = time.perf_counter()
    for i in range(steps):
        fraction = 1.0 if i < copy_warmup else copy_fraction
        ids, targets, mask = training_batch(grammar, rng, batch, copy_fraction=fraction)
        batch_arrays = (jnp.asarray(ids), jnp.asarray(targets), jnp.asarray(mask))
        model, opt_state, loss = train_step(model, opt_state, *batch_arrays)
        losses.append(loss)
        if i % 50 == 49 or i == steps - 1:
            extra = "" if check is None else f", {check(model)}"
            log(f"  step {i + 1}/{steps}: loss {float(loss):.4f}{extra} "
                f"({time.perf_counter() - start:.0f} s)")
    seconds = time.perf_counter() - start
    losses = [float(x) for x in losses]
    return model, {"steps": steps, "batch": batch, "train_len": TRAIN_LEN, "lr": lr, "seed": seed,
                   "copy_fraction": copy_fraction, "copy_warmup": copy_warmup,
                   "final_loss": float(np.mean(losses[-50:])), "loss_every_50": losses[49::50],
                   "train_seconds": round(seconds, 1)}


@eqx.filter_jit
def _logits(model, ids):
    return jax.vmap(model)(ids)


def held_out(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`(language, copies, copy_mask)`: `n` rows of `TRAIN_LEN + 1` characters of each
    kind (a copying row as `training_batch` writes it), and the `(n, TRAIN_LEN)` mask of
    the copy's targets (the copied characters and the space after them)."""
    grammar = make_grammar()
    rng = np.random.default_rng(seed)
    language = np.stack([encode(text(grammar, rng, TRAIN_LEN + 1)[: TRAIN_LEN + 1])
                         for _ in range(n)])
    copies, copy_mask = [], np.zeros((n, TRAIN_LEN), bool)
    for i in range(n):
        t = copy_text(grammar, rng)
        copies.append(encode((t + ALPHABET[SEP] + t + " " + text(grammar, rng, TRAIN_LEN))
                             [: TRAIN_LEN + 1]))
        copy_mask[i, len(t) : 2 * len(t) + 1] = True
    return language, np.stack(copies), copy_mask


def copy_accuracy(model, n: int = 16, seed: int = 7) -> float:
    """How often `model`'s argmax is the right character of a copy, teacher-forced on
    `held_out` copying rows."""
    _, copies, mask = held_out(n, seed)
    right = np.asarray(jnp.argmax(_logits(model, jnp.asarray(copies[:, :-1])), -1)) == copies[:, 1:]
    return float(right[mask].mean())


def evaluate(target, draft, n: int = 64, seed: int = 7) -> dict:
    """Held-out figures of the pair, teacher-forced on `held_out(n, seed)`:

    - `loss`: each model's mean loss on language rows and on the copy of copying rows;
    - `language_floor`: the best loss on language rows (`entropy_per_char`);
    - `draft_agrees`: how often the draft's argmax equals the target's on language rows:
      at every position, at the first letter of a word, inside words;
    - `target_copies`: how often the target's argmax is the right character of a copy.
    """
    language, copies, copy_mask = held_out(n, seed)
    out = {"n": n, "seed": seed, "loss": {}, "language_floor": entropy_per_char(make_grammar())}
    argmax = {}

    def loss(logits, rows, mask=None):  # cross_entropy of logits computed already
        mask = None if mask is None else jnp.asarray(mask)
        return float(eqrope.cross_entropy(lambda x: x, logits, jnp.asarray(rows[:, 1:]), mask))

    for name, model in (("target", target), ("draft", draft)):
        lang_logits = _logits(model, jnp.asarray(language[:, :-1]))
        copy_logits = _logits(model, jnp.asarray(copies[:, :-1]))
        out["loss"][name] = {"language": loss(lang_logits, language),
                             "copy": loss(copy_logits, copies, copy_mask)}
        argmax[name] = [np.asarray(jnp.argmax(logits, -1)) for logits in (lang_logits, copy_logits)]
    same = argmax["target"][0] == argmax["draft"][0]
    word_start = language[:, :-1] == SPACE  # the next character starts a word
    out["draft_agrees"] = {"all": float(same.mean()), "word_starts": float(same[word_start].mean()),
                           "inside_words": float(same[~word_start].mean())}
    out["target_copies"] = float((argmax["target"][1] == copies[:, 1:])[copy_mask].mean())
    return out


def train_pair(folder: pathlib.Path = CHECKPOINTS, *, target_training: dict = TARGET_TRAINING,
               draft_training: dict = DRAFT_TRAINING, log=print) -> tuple:
    """Train the target and the draft, save them with `eqrope.save` in `folder/target` and
    `folder/draft`, and write `folder/train.json` (settings, losses, time, `evaluate`).

    **Returns:** `(target, draft, info)`.
    """
    models, info = {}, {"vocab": ALPHABET, "grammar_seed": GRAMMAR_SEED}
    for name, sizes, settings in (("target", TARGET_SIZES, target_training),
                                  ("draft", DRAFT_SIZES, draft_training)):
        model = build(sizes, key=jax.random.PRNGKey(settings["seed"]))
        log(f"training the {name} ({eqrope.count_params(model):,} parameters)")
        check = lambda m: f"copies {copy_accuracy(m):.3f}"
        models[name], info[name] = train(model, **settings, check=check, log=log)
        info[name]["params"] = eqrope.count_params(model)
    info["evaluation"] = evaluate(models["target"], models["draft"])
    for name, model in models.items():
        path = eqrope.save(folder / name, model)
        info[name]["nbytes"] = sum(f.stat().st_size for f in path.iterdir())
    (folder / "train.json").write_text(json.dumps(info, indent=2) + "\n")
    return models["target"], models["draft"], info


def load_pair(folder: pathlib.Path = CHECKPOINTS) -> tuple:
    """The committed pair `(target, draft)`, read with `eqrope.load`."""
    missing = [name for name in ("target", "draft") if not (folder / name).is_dir()]
    if missing:
        raise FileNotFoundError(
            f"no trained {' and '.join(missing)} in {folder}; create them with "
            "`python bench/speculative.py --train` (about 11 minutes on 2 cores).")
    return eqrope.load(folder / "target"), eqrope.load(folder / "draft")


if __name__ == "__main__":
    *_, summary = train_pair()
    print(json.dumps(summary["evaluation"], indent=2))
