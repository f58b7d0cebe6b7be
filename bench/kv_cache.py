"""What the KV cache buys, and how close a decode step gets to this machine's memory bandwidth.

    python bench/kv_cache.py            # --quick, the default: under two minutes on 2 cores
    python bench/kv_cache.py --full     # more repeats and sizes (several minutes)
    python bench/kv_cache.py --tiny --out /tmp/x   # tiny sizes, 1 repeat (for the tests)

Writes `kv_cache_cpu.json` and PNG figures to `--out` (default `bench/results/`) and prints
a short table. The sections follow issue 4:

1. the seed's protocol (model (65, 64, 4, 2, 256), key 0, prompt 0..7, 100 new tokens,
   greedy; one warm-up then 5 timed repeats per path), with the seed's JSON keys
   `cache.median_s`, `no_cache.median_s` and `speedup_median`;
2. the textbook chapter's growth protocol (section 2.6, Figure 2.3): seconds to generate
   N tokens from a 4-token prompt, with and without the cache;
3. time to first token: one-pass `model.prefill` against feeding the prompt token by token;
4. tokens/s for a batch of prompts;
5. bytes of the cache, from `eqrope.cache_nbytes` and from the arrays;
6. time of one decode step at position 100 as `max_len` grows;
7. the roofline: the bytes a batch-1 decode step must read over its time, beside this
   machine's measured copy bandwidth.

Targets are reported (target, measured, met), never asserted.
"""

import argparse
import pathlib
import re
import statistics
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import eqrope
from _timing import compile_seconds, machine_info, time_call, without_result, write_json


RESULTS = pathlib.Path(__file__).resolve().parent / "results"

# The seed's protocol; identical in every mode except --tiny, which shortens it.
SEED_MODEL = dict(vocab_size=65, d_model=64, n_heads=4, n_blocks=2, max_len=256)
# The chapter's growth model (section 2.6): vocab 256, width 256, 4 heads, 4 blocks.
GROWTH_MODEL = dict(vocab_size=256, d_model=256, n_heads=4, n_blocks=4, max_len=1024, d_ff=1024)

MODES = {
    "quick": dict(
        seed_new=100, seed_repeats=5,
        growth=GROWTH_MODEL, growth_prompt=4,
        growth_n=(64, 128, 256, 512), growth_repeats=2,
        uncached_n=(64, 128, 256), uncached_repeats=1,
        prefill_lengths=(16, 64, 256), prefill_repeats=3,
        batches=(1, 8, 32), batch_new=128, batch_repeats=1,
        step_max_lens=(256, 1024, 4096, 8192), step_calls=50,
        copy_mb=256, copy_repeats=5,
    ),
    "full": dict(
        seed_new=100, seed_repeats=5,
        growth=GROWTH_MODEL, growth_prompt=4,
        growth_n=(64, 128, 256, 512), growth_repeats=5,
        uncached_n=(64, 128, 256, 512), uncached_repeats=2,
        prefill_lengths=(16, 64, 256), prefill_repeats=10,
        batches=(1, 8, 32, 128), batch_new=128, batch_repeats=3,
        step_max_lens=(256, 1024, 4096, 8192), step_calls=300,
        copy_mb=256, copy_repeats=10,
    ),
    "tiny": dict(
        # The seed's model stands in for the growth model, so that the compiled programs
        # of the seed section are reused (the tests' run is mostly compile time).
        seed_new=8, seed_repeats=1,
        growth=SEED_MODEL, growth_prompt=4,
        growth_n=(4, 8), growth_repeats=1,
        uncached_n=(4, 8), uncached_repeats=1,
        prefill_lengths=(8,), prefill_repeats=1,
        batches=(1, 2), batch_new=4, batch_repeats=1,
        step_max_lens=(256, 384), step_calls=3,
        copy_mb=8, copy_repeats=1,
    ),
}

# The decode position of the step measurements (clamped to max_len - 1 in --tiny).
STEP_POSITION = 100


class Plain(eqx.Module):
    """A causal model without the cache protocol: only `__call__` and `max_len`.

    `eqrope.generate` then takes its uncached path. The model is a field (not a closure),
    so its weights are arguments of the compiled program, as on the cached path.
    """

    model: eqrope.RotaryDecoder

    def __call__(self, ids):
        return self.model(ids)

    @property
    def max_len(self) -> int:
        return self.model.max_len


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def build(sizes: dict, *, key) -> eqrope.RotaryDecoder:
    sizes = dict(sizes)
    head = [sizes.pop(n) for n in ("vocab_size", "d_model", "n_heads", "n_blocks", "max_len")]
    return eqrope.RotaryDecoder(*head, **sizes, key=key)


def model_record(model) -> dict:
    return {"config": model.config.to_dict(), "params": eqrope.count_params(model)}


def weight_nbytes(model) -> int:
    leaves = jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array))
    return sum(int(leaf.nbytes) for leaf in leaves)


def fresh_cache(model, batch=None):
    """`model.init_cache()` with its own buffer per array, so that it can be donated."""
    return jax.tree.map(jnp.copy, model.init_cache(batch))


def uncached_buckets(text_lengths, max_len: int) -> list[int]:
    """The padded widths the uncached path runs at, for texts of these lengths."""
    from eqrope._generate import uncached_bucket  # descriptive only

    return sorted({uncached_bucket(n, max_len) for n in text_lengths})


def uncached_description(prompt_len: int, max_new: int, max_len: int) -> dict:
    lengths = range(prompt_len, min(prompt_len + max_new, max_len))
    return {
        "how": (
            "eqrope.generate on Plain (an eqx.Module with only __call__ and max_len) takes "
            "the uncached path: a Python loop over new tokens; at every token the whole "
            "text so far is right-padded with zeros to the next power of two (at least 16, "
            "at most max_len) and run through model(ids) by an eqx.filter_jit function, so "
            "it compiles once per padded width; the last real position's logits go to a "
            "jax.jit greedy sampler and the token back to the host. Nothing is reused "
            "between tokens."
        ),
        "padded_widths": uncached_buckets(lengths, max_len),
        "compiled": "once per padded width (eqx.filter_jit), reused across calls",
    }


CACHED_DESCRIPTION = (
    "eqrope.generate on the RotaryDecoder: one eqx.filter_jit program that prefills the "
    "prompt in chunks of 64 and then decodes in a lax.scan of max_len - 1 iterations with "
    "the static cache in the carry (iterations after the last token are skipped by "
    "lax.cond); max_new is traced, so it compiles once per (max_len, batch)."
)


# -- 1. the seed's protocol ------------------------------------------------------------------


def seed_protocol(cfg: dict) -> dict:
    model = build(SEED_MODEL, key=jax.random.PRNGKey(0))
    plain = Plain(model)  # one instance, reused: its compiled widths are reused too
    prompt = jnp.arange(8, dtype=jnp.int32)
    new = cfg["seed_new"]
    cache = time_call(lambda: eqrope.generate(model, prompt, new), repeats=cfg["seed_repeats"])
    no_cache = time_call(lambda: eqrope.generate(plain, prompt, new), repeats=cfg["seed_repeats"])
    same = bool(np.array_equal(np.asarray(cache["result"]), np.asarray(no_cache["result"])))
    return {
        "cache": without_result(cache),
        "no_cache": without_result(no_cache),
        "speedup_median": no_cache["median_s"] / cache["median_s"],
        "seed": {
            **model_record(model),
            "key": 0,
            "prompt": np.asarray(prompt).tolist(),
            "max_new": new,
            "sampling": "greedy (temperature 0)",
            "identical_tokens": same,
            "tokens": np.asarray(cache["result"]).tolist(),
            "cached_path": CACHED_DESCRIPTION,
            "uncached_path": uncached_description(8, new, model.max_len),
            "first_call_ratio_vs_seed": cache["first_s"] / 0.794,
            "per_token_s": {"cache": cache["median_s"] / new, "no_cache": no_cache["median_s"] / new},
            "seed_measured": {"cache": {"first_s": 0.794, "median_s": 0.055},
                              "no_cache": {"first_s": 2.258, "median_s": 1.383},
                              "speedup_median": 25.0},
        },
    }


# -- 2. the growth protocol ------------------------------------------------------------------


def growth_protocol(cfg: dict, model) -> dict:
    plain = Plain(model)
    prompt = jnp.arange(cfg["growth_prompt"], dtype=jnp.int32)
    max_len = model.max_len
    # Warm-up. The cached program traces max_new, so one call compiles it for every N. The
    # uncached path compiles once per padded width: one generated token from a prompt of
    # each width's length compiles (and runs) that width once.
    cached_first = time_call(lambda: eqrope.generate(model, prompt, 1), repeats=1)["first_s"]
    texts = range(cfg["growth_prompt"], cfg["growth_prompt"] + max(cfg["uncached_n"]))
    widths = uncached_buckets(texts, max_len)
    start = time.perf_counter()
    for width in widths:
        eqrope.generate(plain, jnp.zeros((min(width, max_len - 1),), jnp.int32), 1)
    uncached_warmup = time.perf_counter() - start

    cached, uncached = {}, {}
    for n in cfg["growth_n"]:
        t = time_call(lambda: eqrope.generate(model, prompt, n), repeats=cfg["growth_repeats"])
        cached[n] = t
        log(f"  growth cached N={n}: {t['median_s']:.3f} s")
    for n in cfg["uncached_n"]:
        # Every width is compiled above, so the first call is already a timed repeat.
        t = time_call(lambda: eqrope.generate(plain, prompt, n),
                      repeats=cfg["uncached_repeats"], warmup=0)
        uncached[n] = t
        log(f"  growth uncached N={n}: {t['median_s']:.3f} s")
    identical = {
        str(n): bool(np.array_equal(np.asarray(cached[n]["result"]), np.asarray(uncached[n]["result"])))
        for n in uncached
    }

    def ratio(times, a, b):
        return times[a]["median_s"] / times[b]["median_s"] if a in times and b in times else None

    hi = max(cfg["growth_n"])
    lo = hi // 2
    return {
        **model_record(model),
        "note": (
            "eqrope defaults (RMSNorm, SwiGLU, no biases): the chapter's 3,290,880 "
            "parameters are the same sizes with norm='layer', mlp='gelu', bias=True."
        ),
        "prompt_len": cfg["growth_prompt"],
        "n": list(cfg["growth_n"]),
        "cached": {str(n): without_result(t) for n, t in cached.items()},
        "uncached": {str(n): without_result(t) for n, t in uncached.items()},
        "cached_compile_first_s": cached_first,
        "uncached_warmup_s": uncached_warmup,
        "uncached_padded_widths": widths,
        "identical_tokens": identical,
        "ratio_hi_lo": {"hi": hi, "lo": lo, "cached": ratio(cached, hi, lo),
                        "uncached": ratio(uncached, hi, lo)},
        "speedup": {str(n): uncached[n]["median_s"] / cached[n]["median_s"] for n in uncached},
        "chapter": {"ratio_512_256": {"uncached": 3.9, "cached": 2.2}, "speedup_512": 8.5},
    }


# -- 3. prefill against token by token -------------------------------------------------------


@eqx.filter_jit
def first_token_prefill(model, ids):
    """One pass over the prompt into a fresh cache; the greedy first token and the cache."""
    logits, cache = model.prefill(ids, model.init_cache(), 0, check=False)
    return jnp.argmax(logits[-1]), cache


@eqx.filter_jit
def first_token_scan(model, ids):
    """The prompt one token at a time (a lax.scan of `model.step`) into a fresh cache."""

    def body(cache, xs):
        token, pos = xs
        logits, cache = model.step(token, cache, pos, check=False)
        return cache, logits

    positions = jnp.arange(ids.shape[0], dtype=jnp.int32)
    cache, logits = jax.lax.scan(body, model.init_cache(), (ids, positions))
    return jnp.argmax(logits[-1]), cache


def make_step(model):
    """`model.step` compiled ahead of time, with the cache donated so it is updated in place.

    **Returns:** `(step, hlo)`: `step(token, pos, cache) -> (logits, cache)` and the text
    of the optimized HLO.
    """
    arrays, static = eqx.partition(model, eqx.is_array)

    def step(arrays, token, pos, cache):
        return eqx.combine(arrays, static).step(token, cache, pos, check=False)

    scalar = jnp.zeros((), jnp.int32)
    compiled = jax.jit(step, donate_argnums=3).lower(arrays, scalar, scalar, fresh_cache(model)).compile()
    return (lambda token, pos, cache: compiled(arrays, token, pos, cache)), compiled.as_text()


_HLO_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) .*\{$")
_HLO_LINE = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\w+)\[([\d,]*)\]\S* ([\w-]+)\(")
_PASS_THROUGH = {"parameter", "get-tuple-element", "bitcast", "tuple", "constant", "while",
                 "conditional", "call"}
_ITEMSIZE = {"f32": 4, "f64": 8, "bf16": 2, "f16": 2, "s8": 1, "s32": 4, "s64": 8}


def full_cache_ops(hlo: str, max_len: int) -> list[dict]:
    """Instructions of the optimized HLO that produce an array with a `max_len` axis.

    A step whose cost follows the position should touch only chunks of the cache. Each
    instruction listed here outputs `max_len` rows: a dynamic-update-slice (or a fusion
    ending in one) usually runs in place on the donated cache and writes only its rows
    (`in_place_update`); anything else (a copy, a slice, a fusion) writes all of them.
    Instructions inside fused computations are not listed (their fusion is). Only
    meaningful when `max_len` equals no other dimension of the model.
    """
    found, computation = [], None
    for line in hlo.splitlines():
        header = _HLO_COMPUTATION.match(line)
        if header is not None:
            computation = header.group(1)
            continue
        match = _HLO_LINE.match(line)
        if match is None or computation is None or computation.startswith(("fused", "wrapped")):
            continue
        name, dtype, dims, op = match.groups()
        shape = [int(d) for d in dims.split(",") if d]
        if max_len in shape and op not in _PASS_THROUGH:
            source = re.search(r'op_name="([^"]+)"', line)
            found.append({
                "instruction": name,
                "op": op,
                "computation": computation,
                "shape": f"{dtype}{shape}",
                "nbytes": int(np.prod(shape)) * _ITEMSIZE.get(dtype, 4),
                "in_place_update": "dynamic-update-slice" in f"{op} {name}",
                "source": source.group(1) if source else None,
            })
    return found


def prefill_protocol(cfg: dict, model, step) -> dict:
    out = {}
    for length in cfg["prefill_lengths"]:
        ids = jnp.arange(length, dtype=jnp.int32) % model.vocab_size
        tokens = [ids[i] for i in range(length)]
        positions = [jnp.asarray(i, jnp.int32) for i in range(length)]

        def loop():
            cache = fresh_cache(model)
            for token, pos in zip(tokens, positions):
                logits, cache = step(token, pos, cache)
            return jnp.argmax(logits), cache

        reps = cfg["prefill_repeats"]
        one = time_call(lambda: first_token_prefill(model, ids), repeats=reps)
        scan = time_call(lambda: first_token_scan(model, ids), repeats=reps)
        python = time_call(loop, repeats=max(1, reps // 2), warmup=0)  # step compiled before
        same = {int(one["result"][0]), int(scan["result"][0]), int(python["result"][0])}
        best = min(scan["median_s"], python["median_s"])
        out[str(length)] = {
            "prefill": without_result(one),
            "token_by_token_scan": without_result(scan),
            "token_by_token_loop": without_result(python),
            "speedup_scan": scan["median_s"] / one["median_s"],
            "speedup_loop": python["median_s"] / one["median_s"],
            "speedup_best": best / one["median_s"],
            "same_first_token": len(same) == 1,
        }
        log(f"  prefill {length}: {one['median_s'] * 1e3:.2f} ms vs scan "
            f"{scan['median_s'] * 1e3:.2f} ms, loop {python['median_s'] * 1e3:.2f} ms")
    return {
        "lengths": list(cfg["prefill_lengths"]),
        "method": (
            "time to first token (greedy) on the growth model, into a fresh cache made "
            "inside the timed call: 'prefill' is one eqx.filter_jit call of "
            "model.prefill(prompt, cache, 0, check=False) and argmax of the last logits; "
            "'token_by_token_scan' is one eqx.filter_jit program with a lax.scan of "
            "model.step(token, cache, pos, check=False) over the prompt; "
            "'token_by_token_loop' is a Python loop of a jax.jit model.step with the cache "
            "donated, one dispatch per token. 'speedup_best' (the target) divides the faster "
            "of the two token-by-token times by the prefill time."
        ),
        "by_length": out,
    }


# -- 4. batch --------------------------------------------------------------------------------


def batch_protocol(cfg: dict, model) -> dict:
    out = {}
    prompt_len = cfg["growth_prompt"]
    new = cfg["batch_new"]
    for batch in cfg["batches"]:
        rows = (jnp.arange(prompt_len, dtype=jnp.int32)[None, :]
                + jnp.arange(batch, dtype=jnp.int32)[:, None]) % model.vocab_size
        # One call with max_new=1 compiles (max_new is traced); the timed calls follow.
        compiled = time_call(lambda: eqrope.generate(model, rows, 1), repeats=1)
        t = time_call(lambda: eqrope.generate(model, rows, new),
                      repeats=cfg["batch_repeats"], warmup=0)
        t["first_s"], t["first_compile"] = compiled["first_s"], compiled["first_compile"]
        generated = int(np.asarray(t["result"]).shape[0]) * new
        out[str(batch)] = {
            **without_result(t),
            "new_tokens": generated,
            "tokens_per_s": generated / t["median_s"],
            "cache_nbytes": eqrope.cache_nbytes(model, batch=batch),
        }
        log(f"  batch {batch}: {generated / t['median_s']:.0f} tokens/s")
    return {
        "batches": list(cfg["batches"]),
        "prompt_len": prompt_len,
        "new_per_row": new,
        "method": (
            "eqrope.generate with a (batch, prompt_len) prompt, greedy, each row "
            "new_per_row tokens; the time includes the prefill. The program is compiled by "
            "a call with max_new=1 (first_s); every timed call is a repeat"
        ),
        "by_batch": out,
    }


# -- 5. cache memory -------------------------------------------------------------------------


def memory_record(name: str, model, batch=None, dtype=None) -> dict:
    """Cache bytes from `eqrope.cache_nbytes` and from the arrays of `model.init_cache`."""
    cache = model.init_cache(batch, dtype=dtype)
    arrays = sum(int(leaf.nbytes) for leaf in jax.tree.leaves(cache))  # every array it holds
    formula = eqrope.cache_nbytes(model, batch=1 if batch is None else batch, dtype=dtype)
    del cache
    config = model.config
    return {
        "name": name,
        "cache_dtype": config.dtype if dtype is None else jnp.dtype(dtype).name,
        "batch": 1 if batch is None else batch,
        "blocks": config.n_blocks,
        "max_len": config.max_len,
        "kv_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "itemsize": jnp.dtype(config.dtype).itemsize,
        "formula_nbytes": formula,
        "arrays_nbytes": arrays,
        "weights_nbytes": weight_nbytes(model),
    }


# -- 6. decode step against max_len ----------------------------------------------------------


def step_cost(cfg: dict, growth) -> tuple[dict, dict]:
    """Time one decode step at each max_len, the sizes' calls interleaved round by round,
    so that load from other processes falls on all of them alike."""
    calls, steps, out, profile = {}, {}, {}, None
    for max_len in cfg["step_max_lens"]:
        sizes = {**cfg["growth"], "max_len": max_len}
        model = growth if max_len == growth.max_len else build(sizes, key=jax.random.PRNGKey(0))
        before = compile_seconds()
        step, hlo = make_step(model)
        after = compile_seconds()
        steps[max_len] = (model, step)
        pos = jnp.asarray(min(STEP_POSITION, max_len - 1), jnp.int32)
        state = {"cache": fresh_cache(model)}

        def call(step=step, pos=pos, state=state):
            logits, state["cache"] = step(jnp.ones((), jnp.int32), pos, state["cache"])
            return logits

        calls[max_len] = call
        out[str(max_len)] = {"pos": int(pos), "cache_nbytes": eqrope.cache_nbytes(model),
                             "first_compile": {k: after[k] - before[k] for k in after}}
        if max_len == max(cfg["step_max_lens"]):
            ops = full_cache_ops(hlo, max_len)
            copies = [op for op in ops if not op["in_place_update"]]
            profile = {"max_len": max_len, "count": len(ops), "materialized": len(copies),
                       "materialized_nbytes": sum(op["nbytes"] for op in copies),
                       "instructions": ops}
    times = {max_len: [] for max_len in calls}
    for max_len, call in calls.items():
        start = time.perf_counter()
        jax.block_until_ready(call())
        out[str(max_len)]["first_s"] = time.perf_counter() - start
    for _ in range(cfg["step_calls"]):
        for max_len, call in calls.items():
            start = time.perf_counter()
            jax.block_until_ready(call())
            times[max_len].append(time.perf_counter() - start)
    for max_len, ts in times.items():
        out[str(max_len)].update(median_s=statistics.median(ts), min_s=min(ts), max_s=max(ts),
                                 times_s=ts, repeats=len(ts), warmup=1)
        log(f"  step at max_len {max_len}: {out[str(max_len)]['median_s'] * 1e3:.2f} ms")
    lo, hi = min(cfg["step_max_lens"]), max(cfg["step_max_lens"])
    record = {
        "max_lens": list(cfg["step_max_lens"]),
        "pos": STEP_POSITION,
        "method": (
            "jax.jit of model.step(token, cache, pos, check=False) (the growth model's sizes "
            "at each max_len, batch 1, same weights), compiled ahead of time (first_compile) "
            "with the cache donated, called at a fixed position; one untimed call each, then "
            "rounds of one timed call per max_len; median of the calls, each including one "
            "dispatch"
        ),
        "by_max_len": out,
        "ratio_hi_lo": {"hi": hi, "lo": lo,
                        "ratio": out[str(hi)]["median_s"] / out[str(lo)]["median_s"]},
        "hlo_full_cache_ops": {
            **profile,
            "note": (
                "instructions of the compiled step at the largest max_len whose output has "
                "a max_len axis (parameters, tuples, loops and fusion bodies excluded); "
                "those not marked in_place_update write max_len rows every time they run "
                "(materialized_nbytes counts each once; inside the loop over blocks it "
                "runs once per block)"
            ),
        },
    }
    return record, steps


# -- 7. roofline -----------------------------------------------------------------------------


def copy_bandwidth(nbytes: int, repeats: int) -> dict:
    """Best-of-`repeats` `np.copyto` of a float32 array of about `nbytes` bytes."""
    n = max(1, nbytes // 4)
    src = np.ones(n, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # touch every page first
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    best = min(times)
    return {
        "array_nbytes": int(src.nbytes),
        "best_s": best,
        "times_s": times,
        "bytes_per_s": 2 * src.nbytes / best,
        "convention": (
            "numpy copyto of one array into another (single thread); a copy reads and writes "
            "every byte, so bandwidth = 2 * array_nbytes / best time"
        ),
    }


def roofline(model, step: dict, copy: dict, growth: dict) -> dict:
    config = model.config
    itemsize = jnp.dtype(config.dtype).itemsize
    row = 2 * config.n_blocks * config.n_kv_heads * config.head_dim * itemsize
    weights = weight_nbytes(model)
    pos = min(STEP_POSITION, config.max_len - 1)
    live = weights + (pos + 1) * row
    static = weights + config.max_len * row
    step_median_s = step["median_s"]
    achieved = live / step_median_s
    out = {
        "dtype": config.dtype,
        "pos": pos,
        "weights_nbytes": weights,
        "cache_row_nbytes": row,
        "bytes_per_step": live,
        "bytes_convention": (
            "every weight array once plus the cache rows 0..pos that a step at pos attends "
            "(pos + 1 rows of keys and values for every block)"
        ),
        "bytes_per_step_static_cache": static,
        "step_median_s": step_median_s,
        "achieved_bytes_per_s": achieved,
        "machine_bytes_per_s": copy["bytes_per_s"],
        "fraction": achieved / copy["bytes_per_s"],
        "fraction_fastest_step": live / step["min_s"] / copy["bytes_per_s"],
        "fraction_if_all_max_len_rows_count": static / step_median_s / copy["bytes_per_s"],
        "memory_copy": copy,
    }
    # The step's bytes may fit in the CPU's last-level cache (see machine.cpu_caches), where
    # a copy runs faster than from DRAM: the same copy with source plus destination the
    # size of one step's reads.
    small = copy_bandwidth(live // 2, max(3, 4 * len(copy["times_s"])))
    out["memory_copy_step_working_set"] = small
    out["fraction_vs_step_working_set_copy"] = achieved / small["bytes_per_s"]
    # The same estimate from inside generate's scan (no per-step dispatch): mean time per
    # token at the largest N, which attends on average to about half of the text.
    hi = str(max(int(n) for n in growth["cached"]))
    per_token = growth["cached"][hi]["median_s"] / int(hi)
    mean_rows = growth["prompt_len"] + int(hi) / 2
    out["generate_per_token_s"] = per_token
    out["generate_fraction"] = (weights + mean_rows * row) / per_token / copy["bytes_per_s"]
    return out


# -- report ----------------------------------------------------------------------------------


def target(name, goal, measured, met) -> dict:
    return {"name": name, "target": goal, "measured": measured,
            "met": None if measured is None else bool(met)}


def targets(result: dict) -> list[dict]:
    growth, prefill = result["growth"], result["prefill"]["by_length"]
    steps = result["step_vs_max_len"]["by_max_len"]
    ratio = growth["ratio_hi_lo"]["cached"] if growth["ratio_hi_lo"]["hi"] == 512 else None
    pre = prefill.get("256", {}).get("speedup_best")
    step = (steps["8192"]["median_s"] / steps["256"]["median_s"]
            if "8192" in steps and "256" in steps else None)
    first = result["cache"]["first_s"] if result["mode"] != "tiny" else None
    fraction = result["roofline"]["fraction"]
    return [
        target("seed: cache speedup (median)", ">= 25", result["speedup_median"],
               result["speedup_median"] >= 25),
        target("growth: cached t(512)/t(256)", "<= 2.1", ratio, ratio is not None and ratio <= 2.1),
        target("prefill 256: speedup over token by token", ">= 10", pre,
               pre is not None and pre >= 10),
        target("seed: cached first call (compile + run), s", "<= 1.5", first,
               first is not None and first <= 1.5),
        target("step at max_len 8192 / max_len 256 (issue 8)", "<= 1.3", step,
               step is not None and step <= 1.3),
        target("roofline fraction, float32, batch 1 (issue 8)", ">= 0.6", fraction, fraction >= 0.6),
    ]


def fmt(x, spec=".3f") -> str:
    return "-" if x is None else format(x, spec)


def table(result: dict) -> str:
    lines = [f"eqrope kv_cache benchmark ({result['mode']}), {result['machine']['cpu_model']}, "
             f"{result['machine']['cpu_count']} CPUs, jax {result['machine']['jax']}"]
    c, u = result["cache"], result["no_cache"]
    lines += [
        "",
        f"seed protocol: {result['seed']['max_new']} new tokens, "
        f"identical tokens: {result['seed']['identical_tokens']}",
        f"  {'path':<10}{'first (s)':>11}{'median (s)':>12}{'min-max (s)':>18}",
        f"  {'cache':<10}{c['first_s']:>11.3f}{c['median_s']:>12.4f}"
        f"{c['min_s']:>9.4f}-{c['max_s']:.4f}",
        f"  {'no cache':<10}{u['first_s']:>11.3f}{u['median_s']:>12.4f}"
        f"{u['min_s']:>9.4f}-{u['max_s']:.4f}",
        f"  speedup of medians: {result['speedup_median']:.1f}x; XLA compile in the first "
        f"calls: cache {c['first_compile']['compile_s']:.2f} s, "
        f"no cache {u['first_compile']['compile_s']:.2f} s",
    ]
    g = result["growth"]
    lines += ["", f"growth protocol ({g['params']:,} params, prompt {g['prompt_len']}): seconds",
              f"  {'N':>5}{'cache':>9}{'no cache':>10}{'speedup':>9}"]
    for n in g["n"]:
        cached = g["cached"][str(n)]["median_s"]
        uncached = g["uncached"].get(str(n), {}).get("median_s")
        lines.append(f"  {n:>5}{cached:>9.3f}{fmt(uncached):>10}"
                     f"{fmt(None if uncached is None else uncached / cached, '.1f'):>9}")
    r = g["ratio_hi_lo"]
    lines.append(f"  t({r['hi']})/t({r['lo']}): cache {fmt(r['cached'], '.2f')}, "
                 f"no cache {fmt(r['uncached'], '.2f')}  (chapter: 2.2, 3.9)")
    lines += ["", "time to first token (ms): prefill | token-by-token scan | loop"]
    for length, p in result["prefill"]["by_length"].items():
        lines.append(f"  {length:>5}: {p['prefill']['median_s'] * 1e3:8.2f} | "
                     f"{p['token_by_token_scan']['median_s'] * 1e3:8.2f} | "
                     f"{p['token_by_token_loop']['median_s'] * 1e3:8.2f}"
                     f"   ({p['speedup_scan']:.1f}x, {p['speedup_loop']:.1f}x)")
    lines += ["", "batch: tokens/s (cache bytes)"]
    for batch, b in result["batch"]["by_batch"].items():
        lines.append(f"  {batch:>5}: {b['tokens_per_s']:10.0f}   ({b['cache_nbytes'] / 2**20:.1f} MiB)")
    lines += ["", "decode step at pos ~100 against max_len: ms (cache MiB)"]
    for max_len, s in result["step_vs_max_len"]["by_max_len"].items():
        lines.append(f"  {max_len:>5}: {s['median_s'] * 1e3:8.3f}   ({s['cache_nbytes'] / 2**20:.1f} MiB)")
    ro = result["roofline"]
    lines += [
        "",
        f"roofline: {ro['bytes_per_step'] / 2**20:.2f} MiB per step in "
        f"{ro['step_median_s'] * 1e3:.3f} ms = {ro['achieved_bytes_per_s'] / 1e9:.2f} GB/s; "
        f"copy {ro['machine_bytes_per_s'] / 1e9:.2f} GB/s; fraction {ro['fraction']:.2f} "
        f"({ro['fraction_fastest_step']:.2f} for the fastest step; "
        f"{ro['fraction_vs_step_working_set_copy']:.2f} against a "
        f"{2 * ro['memory_copy_step_working_set']['array_nbytes'] / 2**20:.0f} MiB copy at "
        f"{ro['memory_copy_step_working_set']['bytes_per_s'] / 1e9:.1f} GB/s)",
        "cache bytes (formula = arrays: "
        f"{all(r['formula_nbytes'] == r['arrays_nbytes'] for r in result['cache_memory']['configurations'])}): "
        + ", ".join(f"{r['name']} {r['arrays_nbytes']:,}"
                    for r in result["cache_memory"]["configurations"][:3]),
        f"exercise 3: cache of the growth model after 512 tokens = "
        f"{result['cache_memory']['exercise_3_nbytes']:,} bytes",
        "",
        "targets:",
    ]
    for t in result["targets"]:
        met = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
        lines.append(f"  {t['name']:<50} {t['target']:>7}  {fmt(t['measured'], '.3g'):>8}  {met}")
    lines.append(f"\nwall time {result['wall_s']:.1f} s, of which XLA compile "
                 f"{result['compile_total']['compile_s']:.1f} s; by section: "
                 + ", ".join(f"{k} {v:.0f} s" for k, v in result["section_wall_s"].items()))
    return "\n".join(lines)


def plot(result: dict, out: pathlib.Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = result["growth"]
    fig, ax = plt.subplots(figsize=(5, 3.6))
    for key, label, marker in (("uncached", "without cache", "o"), ("cached", "with cache", "s")):
        ns = [int(n) for n in g[key]]
        ax.plot(ns, [g[key][str(n)]["median_s"] for n in ns], marker=marker, label=label)
    ax.set_xlabel("tokens generated (N)")
    ax.set_ylabel("seconds")
    ax.set_title(f"Generating N tokens, batch 1, {result['machine']['cpu_count']} CPUs")
    ax.legend()
    fig.tight_layout()
    paths = [out / "kv_cache_growth.png"]
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)

    s = result["step_vs_max_len"]["by_max_len"]
    fig, ax = plt.subplots(figsize=(5, 3.6))
    lens = [int(m) for m in s]
    ax.plot(lens, [s[str(m)]["median_s"] * 1e3 for m in lens], marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("max_len")
    ax.set_ylabel("ms per decode step at pos 100")
    ax.set_ylim(bottom=0)
    ax.set_title("Decode step against max_len")
    fig.tight_layout()
    paths.append(out / "kv_cache_step_vs_max_len.png")
    fig.savefig(paths[1], dpi=120)
    plt.close(fig)
    return [str(p) for p in paths]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_const", dest="mode", const="quick",
                      help="the default: under two minutes on a 2-core CPU")
    size.add_argument("--full", action="store_const", dest="mode", const="full",
                      help="more repeats, N=512 without the cache, batch 128")
    size.add_argument("--tiny", action="store_const", dest="mode", const="tiny",
                      help="tiny sizes and 1 repeat, for the tests")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS,
                        help="folder for kv_cache_cpu.json and the PNGs (default bench/results)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG figures")
    args = parser.parse_args(argv)
    mode = args.mode or "quick"
    cfg = MODES[mode]
    start = time.perf_counter()

    result = {"mode": mode, "machine": machine_info(), "sizes": {k: v for k, v in cfg.items()}}
    sections = {}
    clock = [time.perf_counter()]

    def section(name):
        now = time.perf_counter()
        if sections or name is None:
            sections[list(sections)[-1] if sections else "setup"] = now - clock[0]
        if name is not None:
            sections[name] = None
            log(f"[{mode}] {name} ({now - start:.0f} s)")
        clock[0] = now

    section("seed protocol")
    result.update(seed_protocol(cfg))
    section("growth protocol")
    growth_model = build(cfg["growth"], key=jax.random.PRNGKey(0))
    result["growth"] = growth_protocol(cfg, growth_model)
    section("decode step against max_len")
    result["step_vs_max_len"], steps = step_cost(cfg, growth_model)
    section("prefill")
    result["prefill"] = prefill_protocol(cfg, growth_model, steps[growth_model.max_len][1])
    section("batch")
    result["batch"] = batch_protocol(cfg, growth_model)
    section("roofline and memory")
    copy = copy_bandwidth(cfg["copy_mb"] * 2**20, cfg["copy_repeats"])
    step = result["step_vs_max_len"]["by_max_len"][str(growth_model.max_len)]
    result["roofline"] = roofline(growth_model, step, copy, result["growth"])

    seed_model = build(SEED_MODEL, key=jax.random.PRNGKey(0))
    records = [memory_record("seed", seed_model), memory_record("growth", growth_model),
               memory_record("growth, int8 cache", growth_model, dtype="int8")]
    records += [memory_record(f"growth batch {b}", growth_model, b) for b in cfg["batches"] if b > 1]
    records += [memory_record(f"growth max_len {m}", model) for m, (model, _) in steps.items()
                if m != growth_model.max_len]
    result["cache_memory"] = {
        "configurations": records,
        "exercise_3_nbytes": eqrope.cache_nbytes(growth_model, positions=512),
        "exercise_3_note": (
            "the chapter's timing model after 512 tokens, for a cache that holds only the "
            "positions seen: 2 (keys, values) x 4 blocks x 512 x 256 x 4 bytes"
        ),
    }

    section(None)
    result["section_wall_s"] = sections
    result["compile_total"] = compile_seconds()
    result["wall_s"] = time.perf_counter() - start
    result["targets"] = targets(result)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.no_plots:
        result["figures"] = plot(result, args.out)
    path = write_json(args.out / "kv_cache_cpu.json", result)
    print(table(result))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
