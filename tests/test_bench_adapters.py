"""bench/adapters.py in its tiny mode: every section present, every figure consistent.

Timings are never asserted; the ratios are checked against the raw medians they come
from, the optimizer-state bytes against the adapter's size, and the tokens against each
adapter's own run.
"""

import json
import math
import subprocess
import sys

import pytest
from _bench import BENCH, ROOT, SMOKE_ENV


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("adapters")
    proc = subprocess.run(
        [sys.executable, str(BENCH / "adapters.py"), "--tiny", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=SMOKE_ENV,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "targets:" in proc.stdout
    return json.loads((out / "adapters_cpu.json").read_text())


def close(a, b):
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)


def test_tiny_run_is_consistent(data):
    assert data["mode"] == "tiny" and data["machine"]["jax"]
    t, g, m = data["train"], data["generate"], data["many"]
    for section in (t, g, m):
        for timing in section["timings"].values():
            assert timing["min_s"] <= timing["median_s"] <= timing["max_s"]
            assert "compile_s" in timing["first_compile"]
    assert close(t["time_ratio"], t["timings"]["adapter"]["median_s"] / t["timings"]["full"]["median_s"])
    states = t["optimizer_state_nbytes"]
    assert close(t["state_ratio"], states["adapter"] / states["full"])
    # adam: two float32 moments of each adapter array, and a step count.
    assert states["adapter"] == 2 * 4 * t["adapter_params"] + 4
    assert g["identical_tokens"] and all(m["rows_equal_own_adapter"])
    assert close(g["ratio"], g["timings"]["unmerged"]["median_s"] / g["timings"]["merged"]["median_s"])
    assert close(m["ratio"], m["timings"]["k_adapters"]["median_s"] / m["timings"]["one_adapter"]["median_s"])
    assert [x["met"] for x in data["targets"]] == [
        t["time_ratio"] <= 0.6, t["state_ratio"] <= 0.02, g["ratio"] <= 1.15, m["ratio"] <= 1.3
    ]
