"""bench/first_call.py in its tiny mode: every row present, every figure consistent.

Timings are never asserted: the ratios are checked against the medians they come from,
the cache counts against what a cold and a warm process must see, the tokens against the
floor's, and the targets' flags against their figures.
"""

import math

import pytest
from _bench import smoke_run


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
