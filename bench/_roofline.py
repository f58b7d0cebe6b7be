"""bench/kv_cache.py, sections 5 to 7: what a decode step reads, and how fast.

5. bytes of the cache, from `eqrope.cache_nbytes` and from the arrays;
6. time of one decode step at position 100 as `max_len` grows, and the instructions of the
   compiled step that write every `max_len` row (read with `eqrope.testing.hlo_instructions`);
7. the roofline: the bytes a batch-1 decode step must read over its time, beside this
   machine's measured copy bandwidth.
"""

import dataclasses
import re
import statistics
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import eqrope
import eqrope.testing
from _timing import compile_seconds, compiled_functions, log


# The decode position of the step measurements (clamped to max_len - 1 in --tiny).
STEP_POSITION = 100


def weight_nbytes(model) -> int:
    leaves = jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array))
    return sum(int(leaf.nbytes) for leaf in leaves)


def fresh_cache(model, batch=None):
    """`model.init_cache()` with its own buffer per array, so that it can be donated."""
    return jax.tree.map(jnp.copy, model.init_cache(batch))


# -- 5. cache memory -------------------------------------------------------------------------


def memory_record(name: str, model, batch=None, dtype=None) -> dict:
    """Cache bytes from `eqrope.cache_nbytes` and from the arrays of `model.init_cache`:
    the rows and their scales (`arrays_nbytes`), and any other array the cache holds,
    such as a count of the rows filled (`other_nbytes`)."""
    cache = model.init_cache(batch, dtype=dtype)
    rows = [cache.keys, cache.values, cache.key_scales, cache.value_scales]
    arrays = sum(int(a.nbytes) for a in rows if a is not None)
    every = sum(int(leaf.nbytes) for leaf in jax.tree.leaves(cache))
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
        "other_nbytes": every - arrays,
        "weights_nbytes": weight_nbytes(model),
    }


def cache_memory(seed_model, growth_model, steps: dict, batches) -> dict:
    """Section 5's record: the seed and growth models' caches, the growth model's in int8,
    at each batch above 1 and at each other max_len of `steps` (from `step_cost`)."""
    records = [memory_record("seed", seed_model), memory_record("growth", growth_model),
               memory_record("growth, int8 cache", growth_model, dtype="int8")]
    records += [memory_record(f"growth batch {b}", growth_model, b) for b in batches if b > 1]
    records += [memory_record(f"growth max_len {m}", model) for m, (model, _) in steps.items()
                if m != growth_model.max_len]
    return {
        "configurations": records,
        "exercise_3_nbytes": eqrope.cache_nbytes(growth_model, positions=512),
        "exercise_3_note": (
            "the chapter's timing model after 512 tokens, for a cache that holds only the "
            "positions seen: 2 (keys, values) x 4 blocks x 512 x 256 x 4 bytes"
        ),
    }


# -- 6. decode step against max_len ----------------------------------------------------------


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
    found = []
    for ins in eqrope.testing.hlo_instructions(hlo):
        if ins.computation is None or ins.computation.startswith(("fused", "wrapped")):
            continue
        if ins.shape is not None and max_len in ins.shape and ins.opcode not in _PASS_THROUGH:
            source = re.search(r'op_name="([^"]+)"', ins.line)
            found.append({
                "instruction": ins.name,
                "op": ins.opcode,
                "computation": ins.computation,
                "shape": f"{ins.dtype}{list(ins.shape)}",
                "nbytes": int(np.prod(ins.shape)) * _ITEMSIZE.get(ins.dtype, 4),
                "in_place_update": "dynamic-update-slice" in f"{ins.opcode} {ins.name}",
                "source": source.group(1) if source else None,
            })
    return found


def step_cost(cfg: dict, growth) -> tuple[dict, dict]:
    """Time one decode step at each max_len, the sizes' calls interleaved round by round,
    so that load from other processes falls on all of them alike."""
    calls, steps, out, profile = {}, {}, {}, None
    for max_len in cfg["step_max_lens"]:
        config = dataclasses.replace(cfg["growth"], max_len=max_len)
        model = (growth if max_len == growth.max_len
                 else eqrope.RotaryDecoder.from_config(config, key=jax.random.PRNGKey(0)))
        before, compiled = compile_seconds(), len(compiled_functions())
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
                             "first_compile": {k: after[k] - before[k] for k in after},
                             "first_compiles": len(compiled_functions()) - compiled}
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
