"""Compile time: where the seed's first call goes, depth, and new lengths.

- the seed protocol's first `eqrope.generate` call, split into tracing, lowering to MLIR,
  XLA compiling (from `jax.monitoring`) and the rest (running, and Python);
- the first call of `generate` with 2 and with 24 blocks of the seed's widths: the
  blocks are stacked and scanned, so compile time should not grow with depth
  (`bench/compile_depth.py` measures the same for `model(ids)`);
- new prompt lengths and `max_new` within one cache length: how many XLA compiles such a
  call makes (none, ideally) and its time beside a repeat of the same call.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import eqrope
from _floor import default_cache_len
from _timing import compiled_functions, log, time_call, without_result


def first_call_breakdown(first: dict) -> dict:
    """`first` is the seed protocol's `time_call` record of eqrope's cached path."""
    stages = first["first_compile"]
    run = first["first_s"] - sum(stages.values())
    return {
        "first_s": first["first_s"],
        **stages,
        "run_and_python_s": run,
        "compiles": first["first_compiles"],
        "method": (
            "the seed protocol's first eqrope.generate call in this process (time_call's "
            "first_s); trace_s, lower_s and compile_s are jax.monitoring's "
            "jaxpr_trace_duration, jaxpr_to_mlir_module_duration and "
            "backend_compile_duration events during it, summed over every function "
            "compiled (`compiles` of them); run_and_python_s is the rest"
        ),
    }


def depth_record(cfg: dict, seed_config) -> dict:
    """First calls of `generate` at the seed's widths with each depth of `cfg["depths"]`;
    `max_len` 512 (not the seed's 256) so that no program is already compiled."""
    rows = []
    prompt = jnp.arange(8, dtype=jnp.int32)
    for n_blocks in cfg["depths"]:
        config = dataclasses.replace(seed_config, n_blocks=n_blocks, max_len=512)
        model = eqrope.RotaryDecoder.from_config(config, key=jax.random.PRNGKey(0))
        t = time_call(lambda: eqrope.generate(model, prompt, cfg["seed_new"]), repeats=1)
        rows.append({"n_blocks": n_blocks, "params": eqrope.count_params(model), **without_result(t)})
        log(f"  depth {n_blocks}: first call {t['first_s']:.2f} s")
    lo, hi = rows[0], rows[-1]
    return {
        "rows": rows,
        "first_call_ratio": hi["first_s"] / lo["first_s"],
        "compile_ratio": hi["first_compile"]["compile_s"] / lo["first_compile"]["compile_s"],
        "method": (
            "eqrope.generate(model, arange(8), seed_new) on fresh models of the seed's "
            "widths with each n_blocks and max_len 512: the first call (first_s, compile "
            "stages in first_compile), then one repeat; ratios are deepest / shallowest"
        ),
    }


def new_lengths(cfg: dict, model) -> dict:
    """Calls with prompt lengths and `max_new` not seen before, all within the seed
    protocol's cache length, each then repeated: XLA compiles and times."""
    new = cfg["seed_new"]
    cache_len = default_cache_len(8, new, model.max_len)
    jobs = [(5, new), (11, new - 4), (8, new - new // 4), (13, new - 5)]
    rows = []
    for prompt_len, max_new in jobs:
        prompt = jnp.arange(prompt_len, dtype=jnp.int32) % model.vocab_size
        before = len(compiled_functions())
        t = time_call(lambda: eqrope.generate(model, prompt, max_new), repeats=1)
        compiled = compiled_functions()[before:]
        rows.append({
            "prompt_len": prompt_len,
            "max_new": max_new,
            "default_cache_len": default_cache_len(prompt_len, max_new, model.max_len),
            "new_call_s": t["first_s"],
            "repeat_call_s": t["median_s"],
            "ratio": t["first_s"] / t["median_s"],
            "compiles": len(compiled),
            "compiled": compiled,
            "tokens_len": int(np.asarray(t["result"]).shape[0]),
        })
    compiles = sum(r["compiles"] for r in rows)
    log(f"  new lengths: {compiles} XLA compiles over {len(rows)} calls")
    return {
        "cache_len": cache_len,
        "calls": rows,
        "compiles": compiles,
        "new_call_s_max": max(r["new_call_s"] for r in rows),
        "method": (
            "after the seed protocol, eqrope.generate on the seed model with each "
            "(prompt_len, max_new), all of whose default cache lengths equal the seed "
            "protocol's; compiles counts jax.monitoring backend_compile_duration events "
            "during the first call (compiled: their function names); new_call_s is that "
            "call's time, repeat_call_s the same call again"
        ),
    }
