"""bench/load.py in its quick mode: every case present (loads, times, generate calls),
every figure consistent.

Neither memory nor time is asserted (the shapes are tiny); the ratios are checked against
the raw figures they come from, and the targets' flags against the ratios.
"""

import math
import subprocess
import sys

import pytest
from _bench import BENCH, smoke_run


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    result, stdout = smoke_run("load", "quick", tmp_path_factory.mktemp("load"), "load.json", timeout=300)
    assert "targets:" in stdout
    return result


def close(a, b):
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)


def test_quick_run_is_consistent(data):
    m = data["machine"]
    assert data["mode"] == "quick" and data["repeats"] == 1
    assert m["platform"] and m["cpu_count"] >= 1 and m["python"] and m["jax"] and m["equinox"]
    assert m["numpy"] and m["safetensors"]
    assert len(data["loadavg"]["start"]) == 3 and len(data["loadavg"]["end"]) == 3

    assert set(data["checkpoints"]) == {"smollm2_135m", "qwen2.5_0.5b"}
    smol, qwen = data["checkpoints"]["smollm2_135m"], data["checkpoints"]["qwen2.5_0.5b"]
    assert smol["config"]["dtype"] == "bfloat16" and qwen["config"]["dtype"] == "float32"
    assert set(smol["memory"]) == {"from_hf_stacked", "from_hf_unstacked", "load_file",
                                   "load_stacked", "load_unstacked"}  # fmt: skip
    assert set(qwen["memory"]) == {"from_hf_stacked", "from_hf_unstacked", "load_file"}
    for c in (smol, qwen):
        assert c["file_nbytes"] > 0 and c["params"] > 0
        for name, r in c["memory"].items():
            assert r["growth_nbytes"] == r["peak_after_nbytes"] - r["rss_before_nbytes"]
            assert r["peak_after_nbytes"] >= r["rss_after_nbytes"] > 0, name
            if name.startswith(("from_hf", "load_file")):  # the same files
                assert close(r["ratio"], r["growth_nbytes"] / c["file_nbytes"])
        t = c["time"]
        assert set(t) == {"from_hf", "from_hf_unstacked", "load_file"}
        for timing in t.values():
            assert timing["min_s"] <= timing["median_s"] <= timing["max_s"]
            assert len(timing["times_s"]) == timing["repeats"] == 1
        assert close(c["time_ratio"], t["from_hf"]["median_s"] / t["load_file"]["median_s"])
        assert close(c["time_ratio_unstacked"],
                     t["from_hf_unstacked"]["median_s"] / t["load_file"]["median_s"])  # fmt: skip

        g = c["generate"]
        low = c["config"]["dtype"] == "bfloat16"  # the decoding layout, on the CPU
        assert [g["default"]["layout"], g["stacked"]["layout"]] == ["stacked" if low else "unstacked", "stacked"]
        for r in g.values():
            assert r["dtype"] == c["config"]["dtype"] and len(r["calls"]) == 3
            assert r["growth_nbytes"] == max(x["peak_after_nbytes"] - x["rss_before_nbytes"] for x in r["calls"])
            assert close(r["ratio"], r["growth_nbytes"] / r["weights_nbytes"])

    long = data["long"]
    assert long["max_len"] == 131072 and long["dtype"] == "bfloat16" and long["new_tokens"] == 16
    from_load = long["first_call"]["peak_after_nbytes"] - long["load"]["rss_before_nbytes"]
    assert close(long["load_and_first_over_weights"], from_load / long["weights_nbytes"])

    stacked, unstacked = (smol["memory"][f"from_hf_{x}"]["ratio"] for x in ("stacked", "unstacked"))
    calls = [c["generate"]["default"]["ratio"] for c in (smol, qwen)]
    long = long["load_and_first_over_weights"]
    assert [x["measured"] for x in data["targets"]] == [stacked, unstacked, qwen["time_ratio"], *calls, long]
    assert [x["met"] for x in data["targets"]] == [stacked <= 1.3, unstacked <= 1.3, qwen["time_ratio"] <= 1.5,
                                                   *(r <= 0.1 for r in calls), long <= 2]  # fmt: skip


def test_the_long_section_alone(tmp_path):
    """`--section long` runs section 4 only, with its one target; it cannot `--save` (the
    committed file would lose the other sections)."""
    result, stdout = smoke_run("load", "quick", tmp_path, "load.json", "--section", "long", timeout=300)
    assert result["section"] == "long" and result["checkpoints"] == {}
    long = result["long"]["load_and_first_over_weights"]
    assert [(x["measured"], x["met"]) for x in result["targets"]] == [(long, long <= 2)]
    assert "peak at" in stdout
    refused = subprocess.run([sys.executable, str(BENCH / "load.py"), "--section", "long", "--save"],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert refused.returncode == 2 and "--section long writes a partial result" in refused.stderr
