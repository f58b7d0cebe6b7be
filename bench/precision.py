"""Lower-precision decoding: bfloat16 weights and cache, and an int8 cache, against float32.

For the growth model (vocab 256, width 256, 4 heads, 4 blocks, d_ff 1024, max_len 1024):
the largest logit difference against the float32 model over 64 decode steps after a
64-token prefill, and the median time of a decode step at position ~100 (cache donated).
Writes `precision_cpu.json` to `bench/results/latest/` (ignored by git), or to the
committed `bench/results/` with `--save`, or to the file given by `--out`.

    python bench/precision.py
    python bench/precision.py --save    # update the committed result
"""

import argparse
import statistics
import time

import equinox as eqx
import jax
import jax.numpy as jnp

import eqrope
from _timing import add_output_arguments, machine_info, results_folder, write_json


def variant(name):
    # The same key: initialisation draws in float32 and casts, so the bfloat16 model is
    # the float32 model rounded.
    dtype = jnp.bfloat16 if name == "bfloat16" else None
    model = eqrope.RotaryDecoder(256, 256, 4, 4, 1024, d_ff=1024, dtype=dtype, key=jax.random.PRNGKey(0))
    return model, ("int8" if name == "int8 cache" else None)


def measure(name, ids, reference, repeats):
    model, cache_dtype = variant(name)
    step = eqx.filter_jit(lambda m, t, c, p: m.step(t, c, p), donate="all-except-first")
    cache = model.init_cache(dtype=cache_dtype)
    _, cache = model.prefill(ids[:64], cache)
    errors = []
    for t in range(64, 128):
        logits, cache = step(model, ids[t], cache, jnp.asarray(t, jnp.int32))
        errors.append(float(jnp.max(jnp.abs(logits.astype(jnp.float32) - reference[t]))))
    times = []
    pos = jnp.asarray(100, jnp.int32)
    for _ in range(repeats):
        start = time.perf_counter()
        logits, cache = step(model, ids[100], cache, pos)
        jax.block_until_ready(logits)
        times.append(time.perf_counter() - start)
    return {
        "variant": name,
        "cache_bytes": cache.nbytes,
        "max_abs_logit_error": max(errors),
        "step_median_s": statistics.median(times),
        "step_min_s": min(times),
        "step_max_s": max(times),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_arguments(parser, "the JSON file to write")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    path = args.out or results_folder(args.save) / "precision_cpu.json"
    ids = jax.random.randint(jax.random.PRNGKey(1), (128,), 0, 256, dtype=jnp.int32)
    reference = variant("float32")[0](ids)
    rows = [measure(n, ids, reference, args.repeats) for n in ("float32", "bfloat16", "int8 cache")]
    print(f"{'variant':>12} {'cache MiB':>10} {'max |logit err|':>16} {'step ms':>8}")
    for r in rows:
        print(
            f"{r['variant']:>12} {r['cache_bytes'] / 2**20:>10.2f} "
            f"{r['max_abs_logit_error']:>16.2e} {1e3 * r['step_median_s']:>8.3f}"
        )
    write_json(path, {"machine": machine_info(), "rows": rows})


if __name__ == "__main__":
    main()
