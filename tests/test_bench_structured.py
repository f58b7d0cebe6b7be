"""bench/structured.py in its quick mode: every constraint present, every figure consistent.

No time is asserted; the table bytes are checked against the automaton's own arrays,
compiled here again on the bench's synthetic vocabulary.
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
