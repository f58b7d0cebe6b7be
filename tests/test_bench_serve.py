"""bench/serve.py in its tiny mode: every section present, every figure consistent.

Timings are never asserted. The throughputs are checked against the token counts and wall
times they come from, the workload against its definition, the engine's tokens against
`generate` of each request alone (the bench compares them and the test reads the count),
the compiles after the warm-up, and the targets' flags against the figures.
"""

import math

import numpy as np
import pytest
from _bench import smoke_run


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    data, stdout = smoke_run("serve", "tiny", tmp_path_factory.mktemp("serve"), "serve_cpu.json")
    return data, stdout


def workload(w, requests, seed):
    """The new-token counts, from the workload's definition (issue 39): log-normal."""
    rng = np.random.default_rng(seed)
    news = np.clip(np.round(w["median"] * np.exp(w["sigma"] * rng.standard_normal(requests))), w["low"], w["high"])
    return [int(n) for n in news]


def test_tiny_run_is_consistent(run):
    data, stdout = run
    w, c, p = data["workload"], data["continuous"], data["peer"]
    news = workload(w, w["requests"], 0)
    assert c["new_tokens"] == news and p["new_tokens"] == workload(w, w["peer_requests"], 1)
    assert c["static"]["useful_tokens"] == c["engine"]["useful_tokens"] == sum(news)
    for r in (c["static"], c["engine"], p["engine"]):
        assert math.isclose(r["tokens_per_s"], r["useful_tokens"] / r["wall_s"], rel_tol=1e-9)
    assert math.isclose(c["speedup_over_static"], c["engine"]["tokens_per_s"] / c["static"]["tokens_per_s"])
    # Static batches step finished rows: row-steps are the batches' maxima times their sizes.
    slots = c["slots"]
    steps = sum(max(news[i : i + slots]) * len(news[i : i + slots]) for i in range(0, len(news), slots))
    assert c["static"]["row_steps"] == steps and math.isclose(c["static"]["bound"], steps / sum(news))
    assert data["exactness"]["engine_equals_generate_alone"] == data["exactness"]["checked"] == len(news)
    assert data["exactness"]["static_equals_engine"] == len(news)
    for r in (c["engine"], p["engine"]):
        assert r["compiles_after_warmup"] == 0
        assert r["kv_memory"]["held_within_bound_every_step"] is True
        ttft = [r["ttft_s"][k] for k in ("p50", "p90", "p99", "max")]
        assert np.all(np.diff(ttft) >= 0)
    f = data["first_token"]
    assert math.isclose(f["ratio"], f["engine"]["median_s"] / f["floor"]["median_s"])
    met = {t["name"]: t["met"] for t in data["targets"]}
    assert met["XLA compiles after warm-up"] is True
    assert met["tokens equal generate alone (greedy)"] is True
    assert met["engine / vLLM-CPU (best threads), tokens/s"] is None  # no --peer
    assert p["vllm"] is None
    assert "targets:" in stdout and data["loadavg"]["end"]


def test_tiny_http_run_is_consistent(tmp_path):
    """`--http`: the same workload over HTTP; figures from their own counts."""
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    data, stdout = smoke_run("serve", "tiny", tmp_path, "serve_http_cpu.json", "--http")
    w, c = data["workload"], data["closed"]
    news = workload(w, w["requests"], 0)
    assert c["new_tokens"] == news and c["all_tokens_counted"] is True
    assert c["http"]["completed"] == len(news) and c["http"]["total_output_tokens"] == sum(news)
    assert math.isclose(c["http"]["output_throughput"], sum(news) / c["http"]["duration_s"])
    assert math.isclose(c["ratio"], c["http"]["output_throughput"] / c["engine"]["tokens_per_s"])
    assert c["engine"]["compiles_after_warmup"] == 0
    assert data["exactness"]["http_equals_engine"] == data["exactness"]["checked"] == min(w["check"], len(news))
    b = data["burst"]
    assert b["answered_whole"] + b["refused_503_with_retry_after"] == b["requests"] == 10 * w["slots"]
    assert b["other"] == 0 and b["kv_cache_usage_after"] == 0
    assert data["fuzz"]["server_errors"] == 0 and sum(data["fuzz"]["statuses"].values()) == w["fuzz"]
    for p in data["poisson"]:
        assert p["completed"] == w["poisson_requests"] and p["median_ttft_ms"] <= p["p99_ttft_ms"]
    f = data["first_token"]
    assert math.isclose(f["difference_ms"], (f["http"]["median_s"] - f["engine"]["median_s"]) * 1e3)
    for t in data["targets"]:
        assert t["met"] in (True, False) and t["name"] in stdout
