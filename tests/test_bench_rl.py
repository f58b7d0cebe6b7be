"""bench/rl.py in its tiny mode: every section present, every figure consistent.

Timings are never asserted; the ratios are checked against the raw medians they come
from, the tokens per second against the sizes and the step's time, the rollout's tokens
against `generate`'s, and the targets' flags against the ratios.
"""

import json
import math
import subprocess
import sys

import pytest
from _bench import BENCH, ROOT


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("rl")
    proc = subprocess.run(
        [sys.executable, str(BENCH / "rl.py"), "--tiny", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "targets:" in proc.stdout
    return json.loads((out / "rl_cpu.json").read_text())


def close(a, b):
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)


def timings_of(data):
    yield from data["rollout"]["timings"].values()
    yield from data["update"]["timings"].values()
    for step in data["step"].values():
        yield step["timing"]


def test_tiny_run_is_consistent(data):
    assert data["mode"] == "tiny" and data["machine"]["jax"] and data["machine"]["eqrope"]
    assert len(data["loadavg"]["start"]) == 3 and len(data["loadavg"]["end"]) == 3
    for timing in timings_of(data):
        assert timing["min_s"] <= timing["median_s"] <= timing["max_s"]
        assert len(timing["times_s"]) == timing["repeats"] == 1
        assert "compile_s" in timing["first_compile"]

    r = data["rollout"]
    med = {k: v["median_s"] for k, v in r["timings"].items()}
    assert set(med) == {"rollout", "generate_logprobs", "generate_tokens"}
    assert close(r["ratio"], med["rollout"] / med["generate_logprobs"])
    assert close(r["ratio_vs_tokens_only"], med["rollout"] / med["generate_tokens"])
    # A fair comparison: the same samples, every row to max_new (no EOS).
    assert r["identical_tokens"] and r["every_row_to_max_new"]
    assert r["sizes"]["eos_id"] is None

    u = data["update"]
    med = {k: v["median_s"] for k, v in u["timings"].items()}
    assert set(med) == {"train_step", "update_beta0", "update_beta"}
    assert close(u["ratio_beta0"], med["update_beta0"] / med["train_step"])
    assert close(u["ratio_beta"], med["update_beta"] / med["train_step"])
    assert u["beta"] > 0 and u["metrics_beta"]["ratio_error"] == 0.0

    assert set(data["step"]) == {"growth", "smollm2_135m"}
    for step in data["step"].values():
        s, t = step["sizes"], step["timing"]["median_s"]
        assert s["rows"] == s["batch"] * s["group"] and s["total"] == s["prompt"] + s["max_new"]
        assert s["new_tokens"] == s["rows"] * s["max_new"]
        assert close(step["new_tokens_per_s"], s["new_tokens"] / t)
        assert step["metrics"]["tokens"] == 2 * s["rows"] * s["total"]
        assert close(step["positions_per_s"], step["metrics"]["tokens"] / t)
        assert step["metrics"]["length_mean"] == step["metrics"]["length_max"] == s["max_new"]

    assert [x["measured"] for x in data["targets"]] == [r["ratio"], u["ratio_beta0"], u["ratio_beta"]]
    assert [x["met"] for x in data["targets"]] == [
        r["ratio"] <= 1.1, u["ratio_beta0"] <= 1.1, u["ratio_beta"] <= 1.1
    ]
