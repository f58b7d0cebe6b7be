"""`python bench/serve.py --http`: the engine behind `python -m eqrope.serve`, measured
over HTTP against the same engine in process, in one run.

The checkpoint is the SmolLM2-135M shape with random float32 weights (`_shapes.py`),
written by `eqrope.to_hf` beside a word-level tokenizer with one word per id ("t123"), so
that every token is text and a streamed chunk marks its token's arrival. The server and
the in-process engine are built by the same `Server` class with the same settings, and
share one persistent compilation cache (the second warm-up reads the first's programs).

Parts, as `vllm bench serve` measures them (TTFT at the first chunk with text, ITL
between chunks, TPOT = (E2EL - TTFT) / (tokens - 1)):

- `closed`: the long-tail workload of `serve.py` (every request at once, greedy, no EOS)
  through HTTP (streamed), against `engine_run` of it in process: useful tokens per second.
- `first_token`: one 32-token prompt at a time on an idle server, against the in-process
  engine's submit-to-first-event, medians of the same number of rounds.
- `poisson`: open-loop arrivals at several request rates (exponential gaps, seeded).
- `burst`: ten times the slots at once: each a whole answer or a 503 with Retry-After,
  and `/metrics` shows no page held afterwards.
- `fuzz`: seeded random bodies (fields right and wrong, not JSON): no 5xx.
"""

import asyncio
import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jax
import numpy as np

import eqrope


def write_checkpoint(model, folder: Path) -> Path:
    """`model` as a Hugging Face checkpoint with a word-level tokenizer of its vocabulary."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1} | {f"t{i}": i for i in range(2, model.config.vocab_size)}
    raw = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<s>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    raw.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    raw.add_special_tokens(["<s>", "</s>"])
    eqrope.to_hf(model, folder, drop_head_bias=True)
    raw.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return folder


SERVER_ARGS = dict(slots=8, max_len=1024, page_size=16, prefill_chunk=32, decode_steps=16, max_waiting=64)
# The tiny mode's prompts are 12 tokens: one 16-token piece size halves the prefill
# programs the server (and the engine beside it) compiles.
TINY_SERVER_ARGS = dict(prefill_chunk=16)


@contextlib.contextmanager
def server_process(folder: Path, settings: dict, cache: str, log_file: Path):
    """`python -m eqrope.serve` on a free port of 127.0.0.1; SIGTERM at the end."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in settings.items()]
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": cache, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    with open(log_file, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "eqrope.serve", str(folder), f"--port={port}", *flags,
                                    "--served-model-name=bench", "--log-level=warning"],
                                   stdout=out, stderr=subprocess.STDOUT, env=env)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        start = time.perf_counter()
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited:\n{log_file.read_text()[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        yield url, time.perf_counter() - start
    finally:
        process.terminate()
        process.wait(120)


async def one(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    """One streamed completion: status, TTFT, the gaps between chunks, E2EL, tokens."""
    start = time.perf_counter()
    stamps, tokens = [], 0
    async with client.stream("POST", url + "/v1/completions", json={**body, "stream": True,
                             "stream_options": {"include_usage": True}}) as r:  # fmt: skip
        if r.status_code != 200:
            await r.aread()
            return {"status": r.status_code, "retry_after": r.headers.get("retry-after")}
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                stamps.append(time.perf_counter() - start)
    e2el = time.perf_counter() - start
    return {"status": 200, "ttft": stamps[0] if stamps else None, "itl": np.diff(stamps).tolist(), "e2el": e2el,
            "tokens": tokens, "tpot": (e2el - stamps[0]) / (tokens - 1) if tokens > 1 and stamps else None}


async def send_all(url: str, bodies: list, gaps: list | None = None) -> tuple[list, float]:
    """Send `bodies`, all at once or after `gaps` seconds each; **returns** the answers
    and the wall time from the first send to the last answer."""
    limits = httpx.Limits(max_connections=len(bodies) + 8, max_keepalive_connections=len(bodies) + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:
        start = time.perf_counter()
        tasks = []
        for i, body in enumerate(bodies):
            if gaps is not None and i:
                await asyncio.sleep(gaps[i])
            tasks.append(asyncio.create_task(one(client, url, body)))
        answers = await asyncio.gather(*tasks)
        return answers, time.perf_counter() - start


def summary(answers: list, wall: float) -> dict:
    """`vllm bench serve`'s figures, in its names (milliseconds)."""
    done = [a for a in answers if a["status"] == 200]
    out = {"completed": len(done), "duration_s": wall, "request_throughput": len(done) / wall,
           "output_throughput": sum(a["tokens"] for a in done) / wall, "total_output_tokens": sum(a["tokens"] for a in done)}
    for name, values in (("ttft", [a["ttft"] for a in done]), ("tpot", [a["tpot"] for a in done]),
                         ("itl", [x for a in done for x in a["itl"]])):  # fmt: skip
        values = np.asarray([v for v in values if v is not None], float) * 1e3
        if values.size:
            out |= {f"mean_{name}_ms": float(values.mean()), f"median_{name}_ms": float(np.median(values)),
                    f"p99_{name}_ms": float(np.percentile(values, 99))}
    return out


def metrics(url: str) -> dict:
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("eqrope_") and "{" in line:
            out[line.split("{", 1)[0]] = float(line.rsplit(" ", 1)[1])
    return out


def fuzz_bodies(n: int, seed: int, vocab: int) -> list:
    """Seeded random bodies: plausible fields, wrong types and ranges, unknown names, and
    bodies cut short (not JSON; sent as raw bytes)."""
    rng = random.Random(seed)
    values = [None, True, -1, 0, 1, 3, 2**70, 0.5, -2.5, 1e308, "", "x", "The", [], [1, 2], [[0, 5]], [-1], {},
              {"include_usage": True}, [{"role": "user", "content": "hi"}], [vocab + 5]]  # fmt: skip
    fields = ["prompt", "messages", "max_tokens", "temperature", "top_p", "n", "stream", "logprobs", "echo",
              "stop", "seed", "top_k", "min_p", "stream_options", "presence_penalty", "best_of", "zzz"]  # fmt: skip
    out = []
    for _ in range(n):
        body = {"prompt": rng.choice(["The", [5, 6, 7], ["a", "b"]]), "max_tokens": rng.randint(1, 4)}
        for _ in range(rng.randint(0, 3)):
            body[rng.choice(fields)] = rng.choice(values)
        raw = json.dumps(body)
        out.append(raw[: rng.randint(0, len(raw) - 1)] if rng.random() < 0.05 else raw)
    return out


def fuzz(url: str, bodies: list) -> dict:
    statuses = {}
    with httpx.Client(timeout=120) as client:
        for i, raw in enumerate(bodies):
            path = "/v1/chat/completions" if i % 3 == 0 else "/v1/completions"
            r = client.post(url + path, content=raw.encode(), headers={"content-type": "application/json"})
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            if r.status_code >= 400:
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
    return {"bodies": len(bodies), "statuses": statuses, "server_errors": sum(v for k, v in statuses.items() if k >= 500 and k != 503)}


def text_ids(text: str) -> list[int]:
    """The ids of the word-level tokenizer's text ("t5 t6" -> [5, 6])."""
    return [int(w[1:]) for w in text.split()]


def first_token_rounds(engine, url: str, prompt, rounds: int) -> dict:
    """An idle engine's submit-to-first-token in process, and an idle server's first
    streamed token over one kept-alive connection (as `vllm bench serve` keeps its
    session): a 2-token request each, alternating, after 3 warm-up rounds."""

    def in_process():
        start = time.perf_counter()
        engine.submit(prompt, max_new=2)
        while not any(len(e.tokens) for e in engine.step()):
            pass
        first = time.perf_counter() - start
        while engine.has_work():
            engine.step()
        return first

    body = {"prompt": prompt.tolist(), "max_tokens": 2, "temperature": 0, "ignore_eos": True}

    async def alternate():
        times = {"engine": [], "http": []}
        async with httpx.AsyncClient(timeout=600) as client:
            for i in range(3 + rounds):
                e, h = in_process(), (await one(client, url, body))["ttft"]
                if i >= 3:
                    times["engine"].append(e)
                    times["http"].append(h)
        return times

    times = asyncio.run(alternate())
    out = {name: {"median_s": float(np.median(t)), "min_s": min(t), "max_s": max(t), "rounds": rounds}
           for name, t in times.items()}  # fmt: skip
    # Each HTTP round against the engine round just before it: the median of the pairs'
    # differences (steadier than the difference of the medians when the step time drifts).
    out["difference_ms"] = float(np.median(np.subtract(times["http"], times["engine"]))) * 1e3
    return out


def run(cfg: dict, mode: str, workload, engine_run, work_dir: Path, log) -> dict:
    """Every HTTP part; **returns** the result's dict (without the machine)."""
    from eqrope.serving.server._server import Server

    model = eqrope.RotaryDecoder.from_config(eqrope.DecoderConfig(**cfg["shape"]), key=jax.random.key(0))
    folder = write_checkpoint(model, work_dir / "bench-checkpoint")
    cache = str(eqrope.use_compilation_cache(work_dir / "jax-cache"))
    settings = dict(SERVER_ARGS, **(TINY_SERVER_ARGS if mode == "tiny" else {}), max_len=cfg["max_len"], slots=cfg["slots"])
    result = {"server_settings": settings}
    with server_process(folder, settings, cache, work_dir / "server.log") as (url, ready):
        log(f"  server ready in {ready:.0f} s (loading, and compiling every engine program)")
        served = eqrope.from_hf(folder)
        start = time.perf_counter()
        engine = Server(served, eqrope.Tokenizer.from_pretrained(folder), name="bench", **settings).worker.engine
        result["warmup"] = {"server_ready_s": ready, "in_process_s": time.perf_counter() - start}

        prompts, news = workload(cfg, cfg["requests"], seed=0)
        log(f"  closed loop: {len(prompts)} requests, {sum(news)} new tokens, {cfg['slots']} slots")
        ours = engine_run(engine, prompts, news)
        bodies = [{"prompt": p.tolist(), "max_tokens": n, "temperature": 0, "ignore_eos": True} for p, n in zip(prompts, news)]
        answers, wall = asyncio.run(send_all(url, bodies))
        http = summary(answers, wall)
        log(f"  engine in process {ours['tokens_per_s']:.1f} tokens/s; over HTTP {http['output_throughput']:.1f}")
        result["closed"] = {
            "requests": len(prompts), "new_tokens": news,
            "engine": {k: v for k, v in ours.items() if k != "tokens"}, "http": http,
            "ratio": http["output_throughput"] / ours["tokens_per_s"],
            "all_tokens_counted": sum(a.get("tokens", 0) for a in answers) == sum(news),
        }

        log("  first token on an idle server")
        result["first_token"] = first_token_rounds(engine, url, prompts[0], cfg["first_rounds"])

        result["poisson"] = []
        for rate in cfg["rates"]:
            p, n = workload(cfg, cfg["poisson_requests"], seed=2)
            gaps = np.random.default_rng(3).exponential(1 / rate, len(p)).tolist()
            bodies = [{"prompt": x.tolist(), "max_tokens": k, "temperature": 0, "ignore_eos": True} for x, k in zip(p, n)]
            answers, wall = asyncio.run(send_all(url, bodies, gaps))
            result["poisson"].append({"request_rate": rate, **summary(answers, wall)})
            log(f"  Poisson {rate} req/s: {result['poisson'][-1]['output_throughput']:.1f} tokens/s, "
                f"median TTFT {result['poisson'][-1].get('median_ttft_ms', float('nan')):.0f} ms")

        log(f"  a burst of {10 * cfg['slots']} requests")
        body = {"prompt": prompts[1].tolist(), "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        answers, wall = asyncio.run(send_all(url, [body] * (10 * cfg["slots"])))
        deadline = time.monotonic() + 30
        while (m := metrics(url))["eqrope_kv_cache_usage_ratio"] or m["eqrope_requests_running"]:
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        statuses = [a["status"] for a in answers]
        result["burst"] = {
            "requests": len(answers), "answered_whole": sum(a["status"] == 200 and a["tokens"] == 16 for a in answers),
            "refused_503_with_retry_after": sum(a["status"] == 503 and a.get("retry_after") is not None for a in answers),
            "other": sum(s not in (200, 503) for s in statuses), "wall_s": wall,
            "kv_cache_usage_after": m["eqrope_kv_cache_usage_ratio"], "running_after": m["eqrope_requests_running"],
        }
        log("  fuzz")
        result["fuzz"] = fuzz(url, fuzz_bodies(cfg["fuzz"], seed=0, vocab=cfg["shape"]["vocab_size"]))
        # Exactness over HTTP: the streamed texts' ids are the engine's tokens (ids 0 and 1
        # are special: skipped in text).
        texts = asyncio.run(texts_of(url, bodies_for_exactness(prompts, news, cfg["check"])))
        want = [[t for t in ours["tokens"][i] if t > 1] for i in range(len(texts))]
        result["exactness"] = {"checked": len(texts), "http_equals_engine": sum(text_ids(t) == w for t, w in zip(texts, want))}
    return result


def bodies_for_exactness(prompts, news, count: int) -> list:
    return [{"prompt": p.tolist(), "max_tokens": n, "temperature": 0, "ignore_eos": True} for p, n in list(zip(prompts, news))[:count]]


async def texts_of(url: str, bodies: list) -> list[str]:
    async with httpx.AsyncClient(timeout=3600) as client:
        answers = await asyncio.gather(*(client.post(url + "/v1/completions", json=b) for b in bodies))
    return [a.json()["choices"][0]["text"] for a in answers]


def targets(result: dict, target) -> list:
    closed, first, burst, fuzzed, exact = (result[k] for k in ("closed", "first_token", "burst", "fuzz", "exactness"))
    held = burst["kv_cache_usage_after"] == 0 and burst["running_after"] == 0
    lost = burst["requests"] - burst["answered_whole"] - burst["refused_503_with_retry_after"]
    return [
        target("HTTP / engine in process, useful tokens/s (same workload)", ">= 0.9", closed["ratio"], closed["ratio"] >= 0.9),
        target("first token over HTTP - engine's own, median (ms)", "<= 5", first["difference_ms"], first["difference_ms"] <= 5),
        target("burst of 10x slots: lost or other than 200/503", "<= 0", lost + burst["other"], lost + burst["other"] == 0),
        target("burst: no page or slot held afterwards", "True", held, held),
        target(f"fuzz: 5xx answers to {fuzzed['bodies']} bodies", "<= 0", fuzzed["server_errors"], fuzzed["server_errors"] == 0),
        target("tokens over HTTP equal the engine's (greedy)", f"{exact['checked']}/{exact['checked']}",
               exact["http_equals_engine"], exact["http_equals_engine"] == exact["checked"]),
    ]  # fmt: skip


def report(result: dict, verdict) -> str:
    c, f, b = result["closed"], result["first_token"], result["burst"]
    m = result["machine"]
    lines = [
        f"serve --http benchmark ({result['mode']}), {m['cpu_model']}, {m['cpu_count']} CPUs, jax {m['jax']}, "
        f"load {result['loadavg']['start'][0]:.1f} -> {result['loadavg']['end'][0]:.1f}",
        f"closed loop: {c['requests']} requests, {sum(c['new_tokens'])} new tokens, {result['server_settings']['slots']} slots",
        f"  engine in process {c['engine']['tokens_per_s']:.1f} tokens/s ({c['engine']['wall_s']:.1f} s); over HTTP "
        f"{c['http']['output_throughput']:.1f} ({c['http']['duration_s']:.1f} s): {c['ratio']:.2f}x",
        f"  over HTTP: median TTFT {c['http']['median_ttft_ms']:.0f} ms, median ITL {c['http']['median_itl_ms']:.1f} ms, "
        f"median TPOT {c['http']['median_tpot_ms']:.1f} ms",
        f"first token, idle: engine {f['engine']['median_s'] * 1e3:.1f} ms, HTTP {f['http']['median_s'] * 1e3:.1f} ms "
        f"(+{f['difference_ms']:.1f} ms)",
        "Poisson arrivals:  rate  req/s  tok/s  TTFT med/p99 (ms)  ITL med/p99 (ms)  TPOT med (ms)",
    ]
    for p in result["poisson"]:
        lines.append(f"  {p['request_rate']:>20} {p['request_throughput']:6.2f} {p['output_throughput']:6.1f} "
                     f"{p['median_ttft_ms']:8.0f}/{p['p99_ttft_ms']:<8.0f} {p['median_itl_ms']:8.1f}/{p['p99_itl_ms']:<8.1f} "
                     f"{p['median_tpot_ms']:8.1f}")  # fmt: skip
    lines += [
        f"burst: {b['requests']} at once: {b['answered_whole']} whole, {b['refused_503_with_retry_after']} refused (503), "
        f"{b['other']} other; after: kv usage {b['kv_cache_usage_after']}, running {b['running_after']}",
        f"fuzz: {result['fuzz']['bodies']} bodies, statuses {result['fuzz']['statuses']}",
        f"warm-up: server ready in {result['warmup']['server_ready_s']:.0f} s; in process (from the cache) "
        f"{result['warmup']['in_process_s']:.0f} s",
        "targets:",
    ]
    for t in result["targets"]:
        shown = f"{t['measured']:.3g}" if isinstance(t["measured"], float) else str(t["measured"])
        lines.append(f"  {t['name']:<64} {t['target']:>10} {shown:>8}  {verdict(t['met'])}")
    return "\n".join(lines)


def docs_table(result: dict) -> str:
    """The table docs/serving.md shows of a run (tests/test_serve_docs.py checks that the
    page shows the committed run's)."""
    c, f, b, z = result["closed"], result["first_token"], result["burst"], result["fuzz"]
    slots = result["server_settings"]["slots"]
    rows = [
        "| | measured | target |",
        "|---|---|---|",
        f"| useful tokens/s, {c['requests']} requests at once, {slots} slots: over HTTP / in process | "
        f"{c['http']['output_throughput']:.1f} / {c['engine']['tokens_per_s']:.1f} = {c['ratio']:.2f}x | >= 0.9x |",
        f"| first token on an idle server (32-token prompt): HTTP, in process, paired difference | "
        f"{f['http']['median_s'] * 1e3:.1f} ms, {f['engine']['median_s'] * 1e3:.1f} ms, "
        f"+{f['difference_ms']:.1f} ms | <= +5 ms |",
        f"| a burst of {b['requests']} ({10}x the slots): whole answers, 503s, other | "
        f"{b['answered_whole']}, {b['refused_503_with_retry_after']}, {b['other']}; no page held after: "
        f"{b['kv_cache_usage_after'] == 0} | none lost |",
        f"| fuzzed bodies: 5xx answers | {z['server_errors']} of {z['bodies']} | 0 |",
        f"| streamed tokens equal the engine's (greedy) | {result['exactness']['http_equals_engine']} of "
        f"{result['exactness']['checked']} | all |",
    ]
    rows += ["", "| Poisson arrivals (req/s) | req/s done | tokens/s | TTFT median / p99 (ms) | TPOT median (ms) |",
             "|---|---|---|---|---|"]  # fmt: skip
    for p in result["poisson"]:
        rows.append(f"| {p['request_rate']} | {p['request_throughput']:.2f} | {p['output_throughput']:.1f} | "
                    f"{p['median_ttft_ms']:.0f} / {p['p99_ttft_ms']:.0f} | {p['median_tpot_ms']:.1f} |")  # fmt: skip
    return "\n".join(rows)
