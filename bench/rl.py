"""What a GRPO step costs: its rollout against `generate`, its update against a train step,
and the whole step's tokens per second.

    python bench/rl.py                      # growth and SmolLM2-135M shapes (~3-4 min on 2 cores)
    python bench/rl.py --tiny --out /tmp/x  # shrunk sizes, 1 repeat (for the tests)
    python bench/rl.py --save               # update the committed bench/results/

Every call starts from the same policy and optimizer state, and is timed after a warm-up
call, as the median and min/max of the repeats, the first (compiling) call reported on its
own, the functions compared interleaved round by round (`_timing.time_calls`). The reward
is jittable (the fraction of sampled tokens equal to `TARGET_ID`), there is no EOS, so every
row runs to `max_new`, and the same prompts, key, temperature, `G` and `max_new` go to
both sides of each comparison.

1. `rollout` (growth shape): `GRPOStep.rollout` against `eqrope.generate(...,
   num_samples=G, return_logprobs=True)` (the rollout needs the log-probabilities; the
   target compares with this one), and against `return_logprobs=False`. Same tokens checked.
2. `update` (growth shape): `GRPOStep.update` with `beta=0` (no reference) and with
   `beta=0.04` (one more forward, the reference's) against `eqrope.make_train_step(adam)`
   with the cross-entropy loss on the same `batch * G` texts (prompt plus completion, the
   same positions through the model: the inputs are the whole text, the targets shifted
   by one and the last position left out with `ignore_id`). To see where an update's time
   goes, the forwards alone are timed too (logits; cross-entropy; the GRPO log-probs and
   entropy), without gradients.
3. `step`: the whole fused step (rollout, reward, advantages, update, `beta=0.04` with a
   reference) at the growth shape and at the SmolLM2-135M shape (random weights,
   float32), batch 8 prompts x G = 4: new tokens/s and text positions/s.

Writes `rl_cpu.json` (machine, versions, load averages, every timing, the targets) to
`--out` (default `bench/results/latest/`, ignored by git; `--save`: `bench/results/`) and
prints a table. Targets are reported (target, measured, met), never asserted. `--tiny`
compiles with `--xla_backend_optimization_level=0` (recorded as `xla_flags`), which cuts
its compile time by about a third, so the smoke run stays under 20 s.
"""

import argparse
import os
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import eqrope
from _shapes import SMOLLM2_135M as HF_SMOLLM2_135M, eqrope_config
from _report import fmt, target, timing_head, timing_row, verdict
from _timing import add_output_arguments, log, machine_info, results_folder, time_calls, without_result, write_json


# The growth model of the kv_cache chapter.
GROWTH = dict(vocab_size=256, d_model=256, n_heads=4, n_blocks=4, max_len=1024, d_ff=1024)
# The published SmolLM2-135M shape as eqrope's config; max_len only bounds caches.
SMOLLM2_135M = eqrope_config(HF_SMOLLM2_135M, max_len=2048)
TINY = dict(vocab_size=64, d_model=32, n_heads=2, n_blocks=1, max_len=64, d_ff=64)
TINY_XLA_FLAGS = "--xla_backend_optimization_level=0"
TARGET_ID = 7
TEMPERATURE = 1.0
BETA = 0.04
LR = 1e-5
MODES = {
    "default": dict(
        parts=dict(shape="growth", batch=8, group=4, prompt=16, max_new=32, repeats=5, forwards=True),
        steps={"growth": dict(shape="growth", batch=8, group=4, prompt=16, max_new=32, repeats=5),
               "smollm2_135m": dict(shape="smollm2_135m", batch=8, group=4, prompt=16, max_new=16, repeats=3)},
    ),
    # The two step entries share their shape and sizes: one compile serves both.
    "tiny": dict(
        parts=dict(shape="tiny", batch=2, group=2, prompt=4, max_new=4, repeats=1),
        steps={"growth": dict(shape="tiny", batch=2, group=2, prompt=4, max_new=4, repeats=1),
               "smollm2_135m": dict(shape="tiny", batch=2, group=2, prompt=4, max_new=4, repeats=1)},
    ),
}  # fmt: skip
SHAPES = {"growth": GROWTH, "smollm2_135m": SMOLLM2_135M, "tiny": TINY}


def loadavg() -> list[float]:
    """/proc/loadavg's 1, 5 and 15 minute averages (empty where there is none)."""
    try:
        with open("/proc/loadavg") as f:
            return [float(x) for x in f.read().split()[:3]]
    except OSError:
        return []


def reward(tokens, prompt_lengths, ends):
    """The fraction of each sample's new tokens equal to `TARGET_ID`: `(batch, G)`."""
    t = jnp.arange(tokens.shape[-1])
    new = (t >= prompt_lengths[:, None, None]) & (t < ends[..., None])
    hits = jnp.sum((tokens == TARGET_ID) & new, -1)
    return (hits / jnp.maximum(jnp.sum(new, -1), 1)).astype(jnp.float32)


def build(shape: str, seed: int = 0):
    return eqrope.RotaryDecoder(**SHAPES[shape], key=jax.random.key(seed))


def prompts_of(model, cfg, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, model.vocab_size, (cfg["batch"], cfg["prompt"])).astype(np.int32)


def sizes(cfg) -> dict:
    rows = cfg["batch"] * cfg["group"]
    return {**cfg, "rows": rows, "total": cfg["prompt"] + cfg["max_new"],
            "new_tokens": rows * cfg["max_new"], "temperature": TEMPERATURE, "eos_id": None}


_STEPS = {}


def grpo(beta: float, cfg):
    """The GRPO step of these sizes, built once (each step object holds its compiled programs)."""
    key = (beta, cfg["group"], cfg["max_new"])
    if key not in _STEPS:
        _STEPS[key] = eqrope.make_grpo_step(optax.adam(LR), reward, group_size=cfg["group"], max_new=cfg["max_new"],
                                            temperature=TEMPERATURE, beta=beta)  # fmt: skip
    return _STEPS[key]


def rollout(model, cfg) -> dict:
    """Target 1: `GRPOStep.rollout` against `generate` with the same request."""
    prompts, key, n, g = prompts_of(model, cfg), jax.random.key(0), cfg["max_new"], cfg["group"]
    step = grpo(0.0, cfg)
    gen = dict(num_samples=g, temperature=TEMPERATURE, key=key)
    calls = {
        "rollout": lambda: step.rollout(model, prompts, key=key),
        "generate_logprobs": lambda: eqrope.generate(model, prompts, n, return_logprobs=True, **gen),
        "generate_tokens": lambda: eqrope.generate(model, prompts, n, return_logprobs=False, **gen),
    }
    timings = time_calls(calls, repeats=cfg["repeats"], warmup=1)
    ours, theirs = timings["rollout"]["result"], timings["generate_logprobs"]["result"]
    total = cfg["prompt"] + n
    med = {k: v["median_s"] for k, v in timings.items()}
    return {
        "sizes": sizes(cfg),
        "timings": {k: without_result(v) for k, v in timings.items()},
        "identical_tokens": bool(np.array_equal(np.asarray(ours.tokens), np.asarray(theirs.tokens))
                                 and np.array_equal(np.asarray(theirs.tokens), np.asarray(timings["generate_tokens"]["result"]))),
        "every_row_to_max_new": bool(np.all(np.asarray(ours.ends) == total) and np.all(np.asarray(theirs.lengths) == total)),
        "ratio": med["rollout"] / med["generate_logprobs"],
        "ratio_vs_tokens_only": med["rollout"] / med["generate_tokens"],
        "compared_with": "generate(..., num_samples=G, return_logprobs=True), same prompts, key, "
                         "temperature, max_new, cache length; no EOS",
    }  # fmt: skip


def update(model, cfg) -> dict:
    """Target 2: `GRPOStep.update` (beta 0, beta > 0) against a cross-entropy train step."""
    opt = optax.adam(LR)
    plain, kl = grpo(0.0, cfg), grpo(BETA, cfg)
    samples = plain.rollout(model, prompts_of(model, cfg), key=jax.random.key(0))
    rewards = np.asarray(reward(samples.tokens, samples.prompt_lengths, samples.ends))
    rows = cfg["batch"] * cfg["group"]
    tokens = np.asarray(samples.tokens).reshape(rows, -1)
    # The same positions through the model as the GRPO update's forward: the whole text in,
    # the next token out, the last position (no next token) left out by ignore_id.
    x = jnp.asarray(tokens)
    y = jnp.asarray(np.concatenate([tokens[:, 1:], np.full((rows, 1), -100, np.int32)], axis=1))
    state = eqrope.init_optimizer(opt, model)
    train = eqrope.make_train_step(opt)
    reference = model
    calls = {
        "train_step": lambda: train(model, state, x, y),
        "update_beta0": lambda: plain.update(model, state, samples, rewards),
        "update_beta": lambda: kl.update(model, state, samples, rewards, reference=reference),
    }
    timings = time_calls(calls, repeats=cfg["repeats"], warmup=1)
    med = {k: v["median_s"] for k, v in timings.items()}
    metrics = {k: float(v) for k, v in timings["update_beta"]["result"][2].items()}
    forward = None
    if cfg.get("forwards"):
        # Where an update's time goes: the forwards alone (no gradient), each its own program.
        from eqrope.rl._objective import rollout_logprobs

        fwd = {
            "logits": eqx.filter_jit(lambda m, x: jax.vmap(m)(x)),
            "cross_entropy": eqx.filter_jit(lambda m, x, y: eqrope.cross_entropy(m, x, y)),
            "grpo_logprobs_entropy": eqx.filter_jit(lambda m, x: rollout_logprobs(m, x, TEMPERATURE)),
        }
        forward = time_calls({"logits": lambda: fwd["logits"](model, x),
                              "cross_entropy": lambda: fwd["cross_entropy"](model, x, y),
                              "grpo_logprobs_entropy": lambda: fwd["grpo_logprobs_entropy"](model, x)},
                             repeats=cfg["repeats"], warmup=1)
        forward = {k: without_result(v) for k, v in forward.items()}
    return {
        "sizes": sizes(cfg), "beta": BETA, "optimizer": f"adam({LR})",
        "timings": {k: without_result(v) for k, v in timings.items()},
        "ratio_beta0": med["update_beta0"] / med["train_step"],
        "ratio_beta": med["update_beta"] / med["train_step"],
        "metrics_beta": metrics,
        "forwards_alone": forward,
        "compared_with": "make_train_step(adam) with cross_entropy on the batch * G texts "
                         "(inputs: the whole text; targets: shifted by one, last left out)",
    }  # fmt: skip


def whole_step(model, cfg) -> dict:
    """The fused step (beta 0.04, a reference): tokens per second."""
    step, key = grpo(BETA, cfg), jax.random.key(0)
    prompts, state = prompts_of(model, cfg), eqrope.init_optimizer(optax.adam(LR), model)
    calls = {"step": lambda: step(model, state, prompts, key=key, reference=model)}
    timing = time_calls(calls, repeats=cfg["repeats"], warmup=1)["step"]
    metrics = {k: float(v) for k, v in timing["result"][2].items()}
    s = sizes(cfg)
    return {
        "sizes": s, "beta": BETA, "params": eqrope.count_params(model), "dtype": "float32",
        "timing": without_result(timing), "metrics": metrics,
        "new_tokens_per_s": s["new_tokens"] / timing["median_s"],
        "positions_per_s": metrics["tokens"] / timing["median_s"],
        "convention": "new_tokens_per_s = batch * G * max_new / median step time; positions_per_s "
                      "= the step's metric `tokens` (text positions through the policy: the "
                      "rollout's and the update's, batch * G * total * 2) / median step time",
    }  # fmt: skip


def targets(result: dict) -> list[dict]:
    r, u = result["rollout"], result["update"]
    return [
        target("rollout / generate(return_logprobs=True) (medians)", "<= 1.1", r["ratio"], r["ratio"] <= 1.1),
        target("update beta=0 / cross-entropy train step (medians)", "<= 1.1", u["ratio_beta0"], u["ratio_beta0"] <= 1.1),
        target(f"update beta={u['beta']} / cross-entropy train step (medians)", "<= 1.1", u["ratio_beta"], u["ratio_beta"] <= 1.1),
    ]  # fmt: skip


def table(result: dict) -> str:
    row = lambda name, r: timing_row(name, r, 20)  # noqa: E731
    head = timing_head(20)
    m, r, u = result["machine"], result["rollout"], result["update"]
    rs = r["sizes"]
    lines = [f"eqrope GRPO benchmark ({result['mode']}), {m['cpu_model']}, {m['cpu_count']} CPUs, "
             f"jax {m['jax']}; load average {result['loadavg']['start']} -> {result['loadavg']['end']}",
             "", f"rollout ({rs['shape']}): {rs['batch']} prompts x G={rs['group']}, prompt {rs['prompt']}, "
             f"{rs['max_new']} new tokens, T={rs['temperature']}, no EOS; identical tokens: "
             f"{r['identical_tokens']}, every row to max_new: {r['every_row_to_max_new']}", head]
    lines += [row(k, v) for k, v in r["timings"].items()]
    lines += [f"  rollout / generate(return_logprobs=False): {r['ratio_vs_tokens_only']:.3f}",
              "", f"update ({rs['shape']}): {rs['rows']} texts x {rs['total']} tokens, {u['optimizer']}", head]
    lines += [row(k, v) for k, v in u["timings"].items()]
    if u.get("forwards_alone"):
        lines += ["  forwards alone (no gradient):"]
        lines += [row(k, v) for k, v in u["forwards_alone"].items()]
    lines += ["", "whole step (rollout + reward + update, beta 0.04 with a reference):",
              f"  {'shape':<14}{'rows x total':>13}{'median s':>10}{'min-max s':>17}{'compile s':>10}"
              f"{'new tok/s':>11}{'pos/s':>9}"]
    for name, s in result["step"].items():
        t, z = s["timing"], s["sizes"]
        lines.append(f"  {name:<14}{z['rows']:>8} x {z['total']:<3}{t['median_s']:>10.3f}"
                     f"{t['min_s']:>10.3f}-{t['max_s']:.3f}{t['first_compile']['compile_s']:>10.2f}"
                     f"{s['new_tokens_per_s']:>11.1f}{s['positions_per_s']:>9.0f}")
    lines += ["", "targets:"]
    lines += [f"  {x['name']:<58}{x['target']:>8}{fmt(x['measured']):>9}  {verdict(x['met'])}"
              for x in result["targets"]]
    lines.append(f"\nwall time {result['wall_s']:.0f} s; by section: "
                 + ", ".join(f"{k} {v:.0f} s" for k, v in result["section_wall_s"].items()))
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="shrunk sizes and 1 repeat, for the tests")
    add_output_arguments(parser, "folder for rl_cpu.json")
    args = parser.parse_args(argv)
    mode = "tiny" if args.tiny else "default"
    cfg = MODES[mode]
    if args.tiny and jax._src.xla_bridge.backends_are_initialized():
        log("note: JAX's backend is already up; --tiny's faster XLA compile flag is not applied")
    elif args.tiny:
        # The smoke run times nothing worth keeping: compile fast (about a third less
        # compile time) rather than well. Read when the backend starts, below.
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + TINY_XLA_FLAGS).strip()
    out = args.out if args.out is not None else results_folder(args.save)
    start = time.perf_counter()
    result = {"mode": mode, "machine": machine_info(), "xla_flags": os.environ.get("XLA_FLAGS"), "reward": f"fraction of new tokens == {TARGET_ID}",
              "configs": {}, "loadavg": {"start": loadavg()}, "section_wall_s": {}}  # fmt: skip
    models = {}

    def model_of(shape):
        if shape not in models:
            models[shape] = build(shape)
            result["configs"][shape] = models[shape].config.to_dict()
        return models[shape]

    sections = [("rollout", lambda: rollout(model_of(cfg["parts"]["shape"]), cfg["parts"])),
                ("update", lambda: update(model_of(cfg["parts"]["shape"]), cfg["parts"]))]
    sections += [(f"step_{name}", (lambda c=c: whole_step(model_of(c["shape"]), c))) for name, c in cfg["steps"].items()]
    result["step"] = {}
    for name, fn in sections:
        log(f"[{mode}] {name} ({time.perf_counter() - start:.0f} s, load {loadavg()})")
        begin = time.perf_counter()
        value = fn()
        value["loadavg_after"] = loadavg()
        if name.startswith("step_"):
            result["step"][name[len("step_"):]] = value
        else:
            result[name] = value
        result["section_wall_s"][name] = time.perf_counter() - begin
    result["loadavg"]["end"] = loadavg()
    result["targets"] = targets(result)
    result["wall_s"] = time.perf_counter() - start
    path = write_json(out / "rl_cpu.json", result)
    print(table(result))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
