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
    assert list(r["steps"]) == ["greedy", "sampled"] and r["target_ratio"] == 1.15
    for i, step in enumerate(r["steps"].values()):
        # Every call's loop ran all its steps (the free-text row, last, never ends; the
        # unconstrained rows have no EOS id), so the steps compared are the same.
        for name, new in step["new_tokens"].items():
            n = r["long" if name.endswith("long") else "short"]
            assert new[-1] == n and max(new) == n and len(new) == r["batch"], name
            assert name.startswith("constrained") or new == [n] * r["batch"], name
        t = step["timings"]
        for kind in ("plain", "constrained"):
            for stat, field in (("median_s", "per_step_s"), ("min_s", "per_step_min_s")):
                per_step = (t[f"{kind}_long"][stat] - t[f"{kind}_short"][stat]) / (r["long"] - r["short"])
                assert step[field][kind] == pytest.approx(per_step)
            # One program per variant, whatever max_new and the temperature (both traced).
            assert t[f"{kind}_short"]["first_compiles"] >= (1 if i == 0 else 0) and t[f"{kind}_long"]["first_compiles"] == 0
        assert step["ratio"] == pytest.approx(step["per_step_s"]["constrained"] / step["per_step_s"]["plain"])
        assert step["met"] == (step["ratio"] <= 1.15)
        rounds = [
            (c_long - c_short) / (p_long - p_short)
            for p_short, p_long, c_short, c_long in zip(*(t[k]["times_s"] for k in ("plain_short", "plain_long", "constrained_short", "constrained_long")))
        ]  # fmt: skip
        assert step["paired_ratios"] == pytest.approx(rounds) and len(rounds) == r["repeats"]
    assert r["met"] == all(step["met"] for step in r["steps"].values())
    mask = r["mask_alone"]
    assert mask["per_step_s"] == pytest.approx(mask["median_s"] / mask["steps"])
    assert mask["fraction_of_greedy_step"] == pytest.approx(mask["per_step_s"] / r["steps"]["greedy"]["per_step_s"]["plain"])
    assert r["twenty"] == {"constraints": 20, "calls": 20, "new_compiles": 0, "compiled": []}
    assert len(data["machine"]["load_average"]) == 3
