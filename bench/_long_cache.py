"""A model built for long texts, used for a short job: time and peak memory.

- time: the seed's sizes built with a large `max_len` (131072), 10 new tokens after an
  8-token prompt, against the same job on the seed's `max_len` 256, calls interleaved;
- memory: in a fresh process (`python bench/_long_cache.py MAX_LEN NEW WARM...`), the
  growth of the peak resident set (`ru_maxrss`, reset to the current RSS just before)
  over one `eqrope.generate` call of `NEW` tokens on the seed's sizes built with
  `MAX_LEN` (whose full cache is `eqrope.cache_nbytes(model)`), after warm-up calls on
  models of each `max_len` WARM (256 and 512). JAX's CPU buffers are not Python
  objects, so tracemalloc does not see them; the peak RSS does.
"""

import dataclasses
import json
import pathlib
import resource
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

import eqrope
from _protocols import SEED_MODEL
from _timing import log, time_calls, without_result


PROMPT_LEN = 8


def seed_sized(max_len: int):
    config = dataclasses.replace(SEED_MODEL, max_len=max_len)
    return eqrope.RotaryDecoder.from_config(config, key=jax.random.PRNGKey(0))


def long_max_len_time(cfg: dict) -> dict:
    long_len, new = cfg["long_max_len"], cfg["long_new"]
    models = {"short": seed_sized(SEED_MODEL.max_len), "long": seed_sized(long_len)}
    prompt = jnp.arange(PROMPT_LEN, dtype=jnp.int32)
    fns = {name: (lambda m=m: eqrope.generate(m, prompt, new)) for name, m in models.items()}
    t = time_calls(fns, repeats=cfg["long_repeats"])
    same = bool(np.array_equal(np.asarray(t["short"]["result"]), np.asarray(t["long"]["result"])))
    ratio = t["long"]["median_s"] / t["short"]["median_s"]
    log(f"  max_len {long_len}: {t['long']['median_s'] * 1e3:.2f} ms, max_len "
        f"{SEED_MODEL.max_len}: {t['short']['median_s'] * 1e3:.2f} ms")
    return {
        "max_lens": {"short": SEED_MODEL.max_len, "long": long_len},
        "prompt_len": PROMPT_LEN,
        "max_new": new,
        "short": without_result(t["short"]),
        "long": without_result(t["long"]),
        "ratio_median": ratio,
        "identical_tokens": same,
        "cache_nbytes_model_max_len": {name: eqrope.cache_nbytes(m) for name, m in models.items()},
        "method": (
            "eqrope.generate(model, arange(prompt_len), max_new) with default arguments on "
            "the seed's sizes (same key) built with each max_len; one warm-up call each, "
            "then rounds of one timed call each; ratio_median = long / short"
        ),
    }


def peak_memory(max_len: int, new: int, warm_ups=(256, 512), timeout: float = 600) -> dict:
    """Run this file as a fresh process and read its JSON line. `warm_ups`: the max_len of
    each warm-up call's model."""
    command = [sys.executable, str(pathlib.Path(__file__).resolve()), str(max_len), str(new),
               *map(str, warm_ups)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"peak-memory subprocess failed:\n{proc.stderr[-4000:]}")
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    log(f"  peak RSS growth, cache {record['cache_nbytes'] / 2**20:.0f} MiB: "
        f"{record['growth_nbytes'] / 2**20:.1f} MiB")
    return record


def _maxrss_nbytes() -> int:
    # Linux reports kilobytes, macOS bytes.
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def _reset_peak() -> bool:
    """Lower the peak RSS to the current RSS (Linux: `5` to `/proc/self/clear_refs`), so
    that a call's growth shows even below an earlier, higher peak (a compile's)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _child(max_len: int, new: int, warm_ups: list[int]) -> dict:
    prompt = jnp.arange(PROMPT_LEN, dtype=jnp.int32)
    for warm in warm_ups:  # XLA's arenas grow over the first compiles
        jax.block_until_ready(eqrope.generate(seed_sized(warm), prompt, new))
    model = seed_sized(max_len)
    reset = _reset_peak()
    before = _maxrss_nbytes()
    tokens = jax.block_until_ready(eqrope.generate(model, prompt, new))
    after = _maxrss_nbytes()
    return {
        "max_len": max_len,
        "max_new": new,
        "prompt_len": PROMPT_LEN,
        "warm_up_max_lens": warm_ups,
        "cache_nbytes": eqrope.cache_nbytes(model),
        "maxrss_before_nbytes": before,
        "maxrss_after_nbytes": after,
        "growth_nbytes": after - before,
        "peak_reset": reset,
        "tokens_len": int(np.asarray(tokens).shape[0]),
        "method": (
            "a fresh Python process: one eqrope.generate call on the seed's sizes at each "
            "max_len of warm_up_max_lens (JAX and XLA loaded; the first compiles grow "
            "XLA's arenas by ~170 MiB, later ones by ~8 MiB), then the model built with "
            "max_len; the peak RSS is reset to the current RSS (/proc/self/clear_refs, "
            "peak_reset) and growth_nbytes = ru_maxrss after one eqrope.generate(model, "
            "arange(prompt_len), max_new) call minus before it (its compile included)"
        ),
    }


if __name__ == "__main__":
    print(json.dumps(_child(int(sys.argv[1]), int(sys.argv[2]), [int(a) for a in sys.argv[3:]])))
