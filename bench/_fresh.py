"""First calls in fresh processes: what a researcher pays at every restart.

`fresh_first_call(job)` runs one job in a new Python process and returns what it
measured: the wall time of the job's first call (compile and run), the process's CPU
seconds over it, and the JAX persistent-cache hits and misses. A job is a dict:

- `who`: `"eqrope"` (`eqrope.generate` on the model held unstacked, as an inference
  user keeps it) or `"floor"` (bench/_floor.py's unrolled floor on the same arrays);
- `config`: an `eqrope.DecoderConfig` as a dict (`to_dict()`), built with key 0;
- `prompt`, `new`: the prompt length (tokens `0, 1, ...`) and the new tokens, greedy;
- `cache_dir`: a directory for JAX's persistent compilation cache
  (`eqrope.use_compilation_cache`), or `None` for none;
- `dump_dir`: a directory where XLA writes the optimised HLO of every program the
  process compiles (`--xla_dump_to`; `_hlo.program_sizes` reads it), or `None`;
- `prefill_only`: time the first token only (eqrope with `max_new=1`; the floor's
  one-pass prefill), after a compiled warm-up, for the time to the first token; both
  hold the whole job's cache (`prompt + new` rows, rounded as `generate` rounds).

The model is built and placed before the clock starts, so the time is the first call
alone, as a script pays it after loading a checkpoint. The record splits the first call's
compile into JAX's stages, from `jax.monitoring`'s durations: `trace_s` (Python tracing to
a jaxpr), `lower_s` (to StableHLO) and `compile_s` (XLA).
"""

import json
import os
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent


def fresh_first_call(job: dict, timeout: float = 1800) -> dict:
    """Run `job` in a fresh process (this file as a script) and return its record."""
    env = dict(os.environ)
    if job.get("dump_dir"):
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_dump_to={job['dump_dir']} --xla_dump_hlo_as_text".strip()
    done = subprocess.run(
        [sys.executable, str(HERE / "_fresh.py"), json.dumps(job)],
        capture_output=True, text=True, timeout=timeout, check=False, env=env,
    )
    if done.returncode != 0:
        raise RuntimeError(f"fresh process for {job['who']} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _child(job: dict) -> dict:
    import collections
    import resource
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np

    import eqrope

    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    seen, spent = collections.Counter(), collections.Counter()
    jax.monitoring.register_event_listener(lambda name, **kw: seen.update([name.split("/")[-1]]))
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: spent.update({name.split("/")[-1]: secs})
    )
    if job.get("cache_dir"):
        eqrope.use_compilation_cache(job["cache_dir"])
    config = eqrope.DecoderConfig.from_dict(job["config"])
    model = eqrope.RotaryDecoder.from_config(config, key=jax.random.PRNGKey(0))
    prompt = jnp.arange(job["prompt"], dtype=jnp.int32) % config.vocab_size
    new = 1 if job.get("prefill_only") else job["new"]
    sys.path.insert(0, str(HERE))
    import _floor

    # The cache of the whole job (`prompt` + `new`), also when only its first token is timed.
    cache_len = _floor.default_cache_len(job["prompt"], job["new"], config.max_len)
    if job["who"] == "eqrope":
        held = model.unstacked()
        run = lambda: np.asarray(eqrope.generate(held, prompt, new, max_len=cache_len))  # noqa: E731
    else:
        w, s = _floor.floor_weights(model)
        held = _floor.unrolled_weights(w)
        if job.get("prefill_only"):
            run = lambda: np.asarray(_floor.floor_prefill_unrolled(held, prompt, s=s, cache_len=cache_len))  # noqa: E731
        else:
            run = lambda: np.asarray(_floor.floor_generate_unrolled(held, prompt, s=s, max_new=new, cache_len=cache_len))  # noqa: E731
    jax.block_until_ready((held, prompt))
    jax.jit(lambda x: x + 1)(1.0).block_until_ready()  # JAX's own first-use costs
    seen.clear()
    spent.clear()
    wall, c = time.perf_counter(), cpu()
    tokens = run()
    record = {"first_s": time.perf_counter() - wall, "first_cpu_s": cpu() - c,
              "cache_hits": seen["cache_hits"], "cache_misses": seen["cache_misses"],
              "trace_s": spent["jaxpr_trace_duration"], "lower_s": spent["jaxpr_to_mlir_module_duration"],
              "compile_s": spent["backend_compile_duration"]}
    if job.get("prefill_only"):
        times = []
        for _ in range(job.get("repeats", 5)):
            wall = time.perf_counter()
            run()
            times.append(time.perf_counter() - wall)
        record.update(median_s=float(np.median(times)), min_s=min(times), max_s=max(times))
    else:
        record["tokens"] = np.asarray(tokens).tolist()
    return record


if __name__ == "__main__":
    print(json.dumps(_child(json.loads(sys.argv[1]))))
