"""bench/vs_transformers.py --tiny --only real: the real-shape code path at shrunk sizes.

The same heads and kv heads as SmolLM2-135M and Qwen2.5-0.5B at head_dim 8 and 2 layers:
transformers builds and saves each model, eqrope.from_hf reads it, both generate at
batch 1 and 2, and the memory check runs in its fresh process. Timings are never
asserted; the checks compare each derived figure with the raw ones it comes from.
"""

import json
import math
import runpy
from pathlib import Path

import pytest


BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture(scope="module")
def script():
    pytest.importorskip("transformers")
    pytest.importorskip("torch")
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCH))  # as `python bench/vs_transformers.py` has it
        yield runpy.run_path(str(BENCH / "vs_transformers.py"), run_name="vs_transformers")


def close(a, b):
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)


@pytest.mark.hf
def test_real_shapes_tiny(tmp_path, script):
    shapes = script["_real_shapes"]
    # One torch thread: on a busy machine torch's threads stall each other for seconds.
    result = script["main"](["--tiny", "--only", "real", "--torch-threads", "1",
                             "--out", str(tmp_path)])
    assert json.loads((tmp_path / "vs_transformers_cpu.json").read_text())["cases"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vs_transformers_cpu.json"]
    assert [case["case"] for case in result["cases"]] == list(shapes.SHAPES)

    for case in result["cases"]:
        # The published sizes, shrunk only where --tiny says.
        published = shapes.SHAPES[case["case"]][1]
        assert case["hf_config"]["num_attention_heads"] == published["num_attention_heads"]
        assert case["hf_config"]["num_key_value_heads"] == published["num_key_value_heads"]
        assert case["config"]["n_kv_heads"] == published["num_key_value_heads"]
        assert [row["batch"] for row in case["rows"]] == [1, 2]
        for row in case["rows"]:
            assert row["contenders"] == ["eqrope", "hf_default", "hf_default_1thread"]
            assert row["all_full_length"]
            assert row["tokens_len"]["eqrope"] == row["prompt_len"] + row["new_tokens"] == 16
            assert row["identical_tokens"] == {"hf_default": True, "hf_default_1thread": True}
            assert "hf_static" not in row
            best = row["hf_best"]
            assert close(row["speedup_vs_hf_best"], best["median_s"] / row["eqrope"]["median_s"])
        line = case["roofline"]
        b1 = case["rows"][0]
        assert close(line["per_token_s"], b1["eqrope"]["median_s"] / b1["new_tokens"])
        assert close(line["roofline_per_token_s"],
                     line["weights_nbytes"] / line["copy"]["bytes_per_s"])
        assert close(line["fraction"], line["roofline_per_token_s"] / line["per_token_s"])
        assert line["xla_pass"]["bytes_per_s"] > 0
    assert result["cases"][1]["config"]["attention"]["qkv_bias"]  # Qwen2's q/k/v biases

    memory = result["memory"]
    assert memory["dtype"] == "bfloat16"
    assert memory["max_len"] == shapes.MEMORY_MAX_POSITIONS == 131072
    assert memory["first_call"]["tokens_len"] == memory["prompt_len"] + memory["new_tokens"]
    assert memory["first_call"]["peak_reset"]
    assert close(memory["growth_over_weights"], memory["growth_nbytes"] / memory["weights_nbytes"])
    load_and_first = memory["first_call"]["peak_after_nbytes"] - memory["load"]["rss_before_nbytes"]
    assert close(memory["load_and_first_over_weights"], load_and_first / memory["weights_nbytes"])

    assert len(result["targets"]) == 3 * len(shapes.SHAPES) + 2  # and the two memory targets
    for t in result["targets"]:
        assert set(t) == {"target", "goal", "measured", "unit", "met"}
        if "peak RSS" in t["target"]:  # at most the goal
            assert t["met"] == (t["measured"] <= t["goal"])
        else:
            assert t["met"] == (t["measured"] >= t["goal"])
