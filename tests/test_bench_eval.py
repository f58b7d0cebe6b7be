"""bench/eval.py in its quick mode: every key present, every derived figure consistent.

Timings are never asserted; the checks compare each derived figure with the raw ones it
comes from. Needs lm-eval and lm-eval's `hf` model (torch, transformers, accelerate).
"""

import json
import math
import statistics
import subprocess
import sys

import pytest
from _bench import BENCH, ROOT, SMOKE_ENV


pytest.importorskip("lm_eval")


def close(a, b):
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)


def check_timing(t, repeats):
    assert len(t["times_s"]) == repeats == t["repeats"]
    assert close(t["median_s"], statistics.median(t["times_s"]))
    assert t["min_s"] == min(t["times_s"]) and t["max_s"] == max(t["times_s"])
    assert set(t["first_compile"]) == {"trace_s", "lower_s", "compile_s"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    for name in ("torch", "transformers", "accelerate"):
        pytest.importorskip(name)
    out = tmp_path_factory.mktemp("eval")
    proc = subprocess.run(
        [sys.executable, str(BENCH / "eval.py"), "--quick", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        env=SMOKE_ENV,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "eval_cpu.json").read_text()), proc.stdout


@pytest.mark.hf
@pytest.mark.experiment
def test_quick_bench_is_consistent(run):
    data, stdout = run
    assert data["mode"] == "quick"
    for key in (
        "cpu_model",
        "cpu_count",
        "jax",
        "jaxlib",
        "lm_eval",
        "transformers",
        "torch",
        "date",
    ):
        assert data["machine"][key] not in (None, "")
    sizes, e = data["sizes"], data["lm_eval"]
    assert e["requests"] == {"bench_choice": sizes["questions"], "bench_until": sizes["prompts"]}
    expected = {f"eqrope, batch {b}" for b in sizes["eqrope_batches"]}
    expected |= {f"hf, batch {b}" for b in sizes["hf_batches"]}
    assert set(e["runs"]) == expected
    for name, r in e["runs"].items():
        check_timing(r, sizes["repeats"])
        assert name.startswith(r["model"]) and name.endswith(f"batch {r['batch_size']}")
    best = {
        kind: min((r["median_s"], n) for n, r in e["runs"].items() if r["model"] == kind)[1]
        for kind in ("eqrope", "hf")
    }
    assert e["best"] == best
    assert close(
        e["speedup_median"],
        e["runs"][best["hf"]]["median_s"] / e["runs"][best["eqrope"]]["median_s"],
    )
    assert close(
        e["speedup_first"], e["runs"][best["hf"]]["first_s"] / e["runs"][best["eqrope"]]["first_s"]
    )
    # Both models answered the same requests alike (the tests' figure: within 1e-4).
    a = e["agreement"]
    assert a["max_abs_loglikelihood_diff"] < 1e-4 and a["metrics_equal"] is True
    assert a["is_greedy_equal"] == f"{4 * sizes['questions']}/{4 * sizes['questions']}"
    assert a["generated_equal"] == f"{sizes['prompts']}/{sizes['prompts']}"
    assert e["metrics"]["eqrope"] == e["metrics"]["hf"]
    s = data["scoring"]
    check_timing(s["score"], sizes["score_repeats"])
    check_timing(s["matmul"], sizes["score_repeats"])
    tokens = s["batch"] * s["length"]
    assert close(s["tokens_per_s"], tokens / s["score"]["median_s"])
    assert close(s["score_flops_per_s"], 2 * s["matmul_params"] * s["tokens_per_s"])
    assert close(s["matmul_flops_per_s"], 2 * s["matmul_params"] * tokens / s["matmul"]["median_s"])
    assert close(s["fraction_of_matmul"], s["matmul"]["median_s"] / s["score"]["median_s"])
    assert s["matmul_params"] == sum(math.prod(shape[1:]) for shape in s["shapes"])
    for t in data["targets"]:
        assert t["met"] is (t["measured"] >= 3 if "speedup" in t["name"] else t["measured"] >= 0.5)
    assert "targets:" in stdout and "wrote" in stdout
