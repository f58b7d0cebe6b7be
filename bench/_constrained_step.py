"""What a constrained decode step costs (issue 41, part 2 of bench/structured.py).

At a model's shape, with `batch` rows each under its own constraint, against the same
call without constraints, timed in one run, the calls interleaved round by round
(`_timing.time_calls`), after a warm-up call (its compile time reported apart):

- `generate` with `short` and with `long` new tokens, with and without the
  constraints, greedy and sampled (`TEMPERATURES`), the cache length pinned to `prompt_len + long` (`max_new` is traced: one
  program per variant); a step's cost is the difference of the two medians over
  `long - short` (the prefill is the same in both), and also of the two minima, and the
  ratio of each round's differences (paired: load that drifts between rounds falls on
  both variants alike), whose median is reported beside the ratio of the medians. There
  is no EOS id, and one row's regex never ends, so every call's loop runs its `short` or
  `long` steps (rows whose constraint finishes stop early, as in use: the result records
  each row's new tokens);
- the mask alone: `constrain_logits` and `advance` on the call's table, `batch` rows,
  64 steps in one compiled loop (the model's logits replaced by a fixed array), per step;
- the compiles: 20 different constraints, `batch` at a time, in 20 calls of the
  constrained program with the capacity pinned: XLA compiles counted (`jax.monitoring`).
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

import eqrope
from eqrope.generation._constraint import advance, constrain_logits
from eqrope.generation._constraint_table import constraint_of
from eqrope.generation._request import sampling_of
from _timing import compiled_functions, log, time_calls, without_result

FREE_TEXT = eqrope.Regex("[a-z ]*")  # never ends: the loop runs every step
MASK_STEPS = 64
TARGET = 1.15  # a constrained step costs at most this many unconstrained ones (issue 41)
# Greedy decoding, and sampling at temperature 1 (top-k, top-p and min-p off: the
# sampler still sorts the vocabulary of every row at every step, which a masked row's
# mostly `-inf` logits make cheaper).
TEMPERATURES = {"greedy": 0.0, "sampled": 1.0}


def capacity_of(sets) -> tuple[int, int]:
    """The `(states, exceptions)` that hold every set of automata (with FREE)."""
    states = max(1 + sum(a.accepting.size for a in s) for s in sets)
    return states, max(sum(a.exc_token.size for a in s) for s in sets)


def _mask_loop(table, start, logits, sampling):
    """`MASK_STEPS` steps of the mask and the state update alone (argmax as the token)."""

    def one(_, states):
        masked, _ = constrain_logits(table, states, logits, jnp.zeros_like(states), sampling)
        token = jnp.argmax(masked, axis=-1).astype(jnp.int32)
        return advance(table, states, token, jnp.ones(states.shape, bool))

    return jax.lax.fori_loop(0, MASK_STEPS, one, start)


def compare(model, prompts: np.ndarray, rows: list, capacity, *, temperature: float, short: int, long: int,
            repeats: int) -> dict:
    """The four calls at one `temperature`, timed together, and the step costs they give."""
    prompt_len = prompts.shape[1]
    settings = dict(temperature=temperature, key=jax.random.key(0), return_logprobs=True, max_len=prompt_len + long)
    constrained = dict(settings, constraint=rows, constraint_capacity=capacity)
    calls = {
        "plain_short": lambda: eqrope.generate(model, prompts, short, **settings),
        "plain_long": lambda: eqrope.generate(model, prompts, long, **settings),
        "constrained_short": lambda: eqrope.generate(model, prompts, short, **constrained),
        "constrained_long": lambda: eqrope.generate(model, prompts, long, **constrained),
    }
    log(f"timing generate at temperature {temperature}, {short} and {long} new tokens, {repeats} repeats ...")
    timing = time_calls(calls, repeats=repeats, warmup=1)

    def per_step(stat: str) -> dict:
        return {kind: (timing[f"{kind}_long"][stat] - timing[f"{kind}_short"][stat]) / (long - short)
                for kind in ("plain", "constrained")}  # fmt: skip

    medians, minima = per_step("median_s"), per_step("min_s")
    ratio = medians["constrained"] / medians["plain"]
    diffs = {kind: np.subtract(timing[f"{kind}_long"]["times_s"], timing[f"{kind}_short"]["times_s"])
             for kind in ("plain", "constrained")}  # fmt: skip
    paired = (diffs["constrained"] / diffs["plain"]).tolist()
    return {
        "temperature": temperature, "timings": {name: without_result(t) for name, t in timing.items()},
        "new_tokens": {name: (np.asarray(t["result"].lengths) - prompt_len).tolist() for name, t in timing.items()},
        "per_step_s": medians, "per_step_min_s": minima, "ratio": ratio,
        "ratio_of_minima": minima["constrained"] / minima["plain"],
        "paired_ratios": paired, "paired_ratio_median": float(np.median(paired)), "met": bool(ratio <= TARGET),
    }  # fmt: skip


def measure(model, vocabulary, specs: list, *, batch: int, prompt_len: int, short: int, long: int,
            repeats: int) -> dict:
    """The step costs and compile count above, for `specs` (20 constraints) compiled
    against `vocabulary` (a tokenizer's stand-in: `token_bytes()`)."""
    vocab = model.vocab_size
    log(f"compiling {len(specs)} constraints at {vocab} tokens ...")
    start = time.perf_counter()
    automata = [spec.compile(vocabulary, vocab=vocab) for spec in specs]
    compile_constraints_s = time.perf_counter() - start
    rows = automata[: batch - 1] + [FREE_TEXT.compile(vocabulary, vocab=vocab)]
    sets = [rows] + [[automata[(i + j) % len(automata)] for j in range(batch)] for i in range(len(automata))]
    capacity = capacity_of(sets)
    prompts = np.random.default_rng(0).integers(0, vocab, size=(batch, prompt_len)).astype(np.int32)
    steps = {
        name: compare(model, prompts, rows, capacity, temperature=t, short=short, long=long, repeats=repeats)
        for name, t in TEMPERATURES.items()
    }

    log("timing the mask alone ...")
    c = constraint_of(rows, None, capacity, batch=batch, batched=True, samples=None, vocab=vocab)
    sampling, _ = sampling_of(eqrope.GenerationConfig(temperature=1.0), vocab)
    logits = jnp.asarray(np.random.default_rng(1).standard_normal((batch, vocab), np.float32))
    loop = jax.jit(_mask_loop)
    mask = time_calls({"mask": lambda: loop(c.table, jnp.asarray(c.start), logits, sampling)}, repeats=repeats, warmup=1)
    mask = without_result(mask["mask"])
    mask_per_step = mask["median_s"] / MASK_STEPS

    log(f"{len(automata)} constraints through the constrained program ...")
    before = len(compiled_functions())
    for i, s in enumerate(sets[1:]):
        out = eqrope.generate(model, prompts, short, temperature=1.0, key=jax.random.key(i), return_logprobs=True,
                              max_len=prompt_len + long, constraint=s, constraint_capacity=capacity)  # fmt: skip
        jax.block_until_ready(out)
    new_compiles = compiled_functions()[before:]
    return {
        "batch": batch, "prompt_len": prompt_len, "short": short, "long": long, "repeats": repeats,
        "capacity": list(capacity), "table_nbytes": sum(np.asarray(x).nbytes for x in c.table),
        "constraints": [type(s).__name__ for s in specs], "compile_constraints_s": compile_constraints_s,
        "steps": steps, "target_ratio": TARGET, "met": all(r["met"] for r in steps.values()),
        "mask_alone": {**mask, "steps": MASK_STEPS, "per_step_s": mask_per_step,
                       "fraction_of_greedy_step": mask_per_step / steps["greedy"]["per_step_s"]["plain"]},
        "twenty": {"constraints": len(automata), "calls": len(sets) - 1, "new_compiles": len(new_compiles),
                   "compiled": new_compiles},
    }  # fmt: skip
