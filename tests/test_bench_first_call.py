"""bench/first_call.py in its tiny mode: every row present, every figure consistent.

Timings are never asserted: the ratios are checked against the medians they come from,
the cache counts against what a cold and a warm process must see, the tokens against the
floor's, and the targets' flags against their figures.
"""

import math

import pytest
from _bench import load, smoke_run


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("first_call")
    return smoke_run("first_call", "tiny", out, "first_call.json")[0]


def test_tiny_run_is_consistent(data):
    assert data["mode"] == "tiny" and data["machine"]["jax"]
    assert len(data["loadavg"]["start"]) == 3 and len(data["loadavg"]["end"]) == 3
    for row in ("seed", "smollm2_135m"):
        r = data[row]
        assert r["tokens_equal"] is True
        for side in ("eqrope_cold", "floor_cold"):
            assert r[side]["min_s"] <= r[side]["median_s"] <= r[side]["max_s"]
            assert r[side]["cache_hits"] == 0  # no persistent cache in a cold process
        assert math.isclose(r["ratio_cold"], r["eqrope_cold"]["median_s"] / r["floor_cold"]["median_s"])


def test_programs_are_counted_and_stages_fit_in_the_first_call(data):
    for row in ("seed", "smollm2_135m"):
        r = data[row]
        for who in ("eqrope", "floor"):
            p = r["program"][who]
            assert 0 < p["fusions"] <= p["thunks"] <= p["instructions"], p
        assert p["module"] == "jit_floor_generate_unrolled"
        assert math.isclose(r["program"]["thunk_ratio"], r["program"]["eqrope"]["thunks"] / p["thunks"])
        for side in ("eqrope_cold", "floor_cold"):
            stages = r[side]["stages"]
            assert all(v > 0 for v in stages.values()), stages
            assert sum(stages.values()) <= r[side]["max_s"]


# Counted by hand: 10 instructions (3 + 2 + 5); 1 fusion; thunks are the entry's fusion, copy and
# reduce (its `to_apply` and the fusion's body are inlined into their kernels).
HLO = """HloModule jit_f, entry_computation_layout={(f32[4]{0})->f32[]}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%fused_computation (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %m = f32[4]{0} multiply(%p, %p)
}

ENTRY %main.5 (x: f32[4]) -> f32[] {
  %x = f32[4]{0} parameter(0)
  %sq = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_computation
  %c = f32[4]{0} copy(%sq)
  %zero = f32[] constant(0)
  ROOT %r = f32[] reduce(%c, %zero), dimensions={0}, to_apply=%add
}
"""


def test_the_hlo_counts_are_a_hand_count(tmp_path):
    hlo = load("_hlo")
    count, program_sizes = hlo.count, hlo.program_sizes
    assert count(HLO) == {"instructions": 10, "fusions": 1, "thunks": 3}
    (tmp_path / "module_0001.jit_f.cpu_after_optimizations.txt").write_text(HLO)
    (tmp_path / "module_0000.jit_tiny.cpu_after_optimizations.txt").write_text("HloModule jit_tiny, x\n")
    assert program_sizes(tmp_path) == {"module": "jit_f", "instructions": 10, "fusions": 1, "thunks": 3}


def test_the_warm_process_reads_every_program_from_the_cache(data):
    warm = data["seed"]["eqrope_warm"]
    assert warm["cache_hits"] >= 1 and warm["cache_misses"] == 0


def test_targets_follow_the_figures(data):
    assert "first_token" not in data  # timed in the quick and full runs only
    by_name = {t["target"]: t for t in data["targets"]}
    assert by_name["smollm2_135m: first call / floor's, cold"]["measured"] == data["smollm2_135m"]["ratio_cold"]
    for t in data["targets"]:
        bound = float(t["goal"].split()[-1])
        assert t["met"] == (t["measured"] <= bound)
