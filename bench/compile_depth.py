"""Compile time against depth: the blocks are stacked and scanned, so it should not grow.

Builds the seed model's width (65, 64, 4, ·, 256) with 2 and with 24 blocks and times the
first call of `model(ids)` under `eqx.filter_jit` (trace + lower + XLA compile + run),
then the steady state. Writes `compile_depth_cpu.json` to `bench/results/latest/`
(ignored by git), or to the committed `bench/results/` with `--save`, or to the file
given by `--out`.

    python bench/compile_depth.py
    python bench/compile_depth.py --save    # update the committed result
"""

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp

import eqrope
from _timing import (add_output_arguments, machine_info, results_folder, time_call,
                     without_result, write_json)


def measure(n_blocks: int, repeats: int) -> dict:
    model = eqrope.RotaryDecoder(65, 64, 4, n_blocks, 256, key=jax.random.PRNGKey(0))
    ids = jnp.arange(8, dtype=jnp.int32)
    forward = eqx.filter_jit(lambda m, x: m(x))
    timing = time_call(lambda: forward(model, ids), repeats=repeats)
    return {"n_blocks": n_blocks, "params": eqrope.count_params(model), **without_result(timing)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_arguments(parser, "the JSON file to write")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    path = args.out or results_folder(args.save) / "compile_depth_cpu.json"
    rows = [measure(n, args.repeats) for n in (2, 24)]
    ratio = rows[1]["first_s"] / rows[0]["first_s"]
    print(f"{'blocks':>6} {'params':>10} {'first call (s)':>15} {'of it compile (s)':>18} {'steady (ms)':>12}")
    for r in rows:
        print(
            f"{r['n_blocks']:>6} {r['params']:>10,} {r['first_s']:>15.3f} "
            f"{r['first_compile']['compile_s']:>18.3f} {1e3 * r['median_s']:>12.3f}"
        )
    print(f"first call, 24 blocks / 2 blocks: {ratio:.2f}")
    write_json(
        path,
        {"machine": machine_info(), "rows": rows, "first_call_ratio_24_over_2": ratio},
    )


if __name__ == "__main__":
    main()
