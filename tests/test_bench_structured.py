"""bench/structured.py in its quick mode: every constraint present, every figure consistent.

No time is asserted; the table bytes are checked against the automaton's own arrays,
compiled here again on the bench's synthetic vocabulary, and part 2's step costs against
the medians they are computed from.
"""

import pytest

from _bench import BENCH, load, smoke_run


pytest.importorskip("outlines_core")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    result, stdout = smoke_run("structured", "quick", tmp_path_factory.mktemp("structured"), "structured.json", timeout=300)
    assert "flat_record" in stdout
    return result


def test_quick_run_is_consistent(data, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # as `python bench/structured.py` has it
    bench = load("structured")
    assert data["vocab"] == 2048 and data["repeats"] == 1 and data["machine"]["outlines_core"]
    assert set(data["constraints"]) == set(bench.SPECS)
    vocabulary = bench.SyntheticVocabulary(data["vocab"])
    assert len(vocabulary.token_bytes()) == data["vocab"]
    for name, r in data["constraints"].items():
        a = bench.SPECS[name].compile(vocabulary)
        assert r["states"] == a.accepting.size and r["exceptions"] == a.exc_token.size
        assert r["table_nbytes"] == sum(x.nbytes for x in a[:-1])
        assert r["allowed_nbytes"] == a.allowed.nbytes == r["states"] * 4 * (data["vocab"] // 32)
        assert r["dense_int32_nbytes"] == 4 * r["states"] * data["vocab"]
        assert r["min_s"] <= r["median_s"] <= r["max_s"] and len(r["times_s"]) == 1


def test_quick_decode_step_is_consistent(data):
    r = data["decode_step"]
    assert r["batch"] == 8 and r["short"] < r["long"] and len(r["constraints"]) == 20
    # Every row decoded all its tokens in both variants: the steps compared are the same.
    for name, new in r["new_tokens"].items():
        assert new == [r["long" if name.endswith("long") else "short"]] * r["batch"], name
    t = r["timings"]
    for kind in ("plain", "constrained"):
        step = (t[f"{kind}_long"]["median_s"] - t[f"{kind}_short"]["median_s"]) / (r["long"] - r["short"])
        assert r["per_step_s"][kind] == pytest.approx(step)
        assert t[f"{kind}_short"]["first_compiles"] >= 1 and t[f"{kind}_long"]["first_compiles"] == 0
    assert r["ratio"] == pytest.approx(r["per_step_s"]["constrained"] / r["per_step_s"]["plain"])
    assert r["met"] == (r["ratio"] <= r["target_ratio"] == 1.15)
    mask = r["mask_alone"]
    assert mask["per_step_s"] == pytest.approx(mask["median_s"] / mask["steps"])
    assert mask["fraction_of_plain_step"] == pytest.approx(mask["per_step_s"] / r["per_step_s"]["plain"])
    assert r["twenty"] == {"constraints": 20, "calls": 20, "new_compiles": 0, "compiled": []}
    assert len(data["machine"]["load_average"]) == 3
