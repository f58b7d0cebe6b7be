"""The textbook experiments in experiments/: the data generator, and the scripts at reduced
size (marked `experiment`: they train small models in a subprocess)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest


ROOT = Path(__file__).resolve().parent.parent
EXPERIMENTS = ROOT / "experiments"


def load_data_module():
    """experiments/ is a folder of scripts, not a package: load the data module by path."""
    spec = importlib.util.spec_from_file_location("reversal_data", EXPERIMENTS / "reversal_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


data = load_data_module()


# -- the data, checked by hand -------------------------------------------------------------


def test_vocabulary_fits_the_chapters_model():
    # 10 letters + SEP + PAD = 12 ids; 12 letters + SEP + 12 letters = 25 = max_len.
    assert (data.VOCAB_SIZE, data.SEP, data.PAD, data.MAX_LEN) == (12, 10, 11, 25)


def test_encode_and_decode_by_hand():
    # "cat" is not spellable in a..j; "bad" is b=1, a=0, d=3.
    seq = data.encode(np.array([1, 0, 3]))
    assert seq.tolist() == [1, 0, 3, 10, 3, 0, 1]
    assert data.decode(seq.tolist() + [11]) == "bad|dab."


def test_training_batch_marks_exactly_the_answer():
    rng = np.random.default_rng(0)
    ids, targets, mask = data.training_batch(rng, 16, (3, 5))
    assert ids.shape == targets.shape == mask.shape == (16, 25)
    for row_ids, row_targets, row_mask in zip(ids, targets, mask):
        n = int(np.argmax(row_ids == data.SEP))  # the string's length
        assert n in (3, 5)
        string = row_ids[:n]
        # By hand for n = 3, "abc": ids  a b c | c b a . . .
        #                          targets b c | c b a . . . .
        # the answer letters c b a are targets at positions 3, 4, 5 = n .. 2n-1.
        assert row_ids[: 2 * n + 1].tolist() == string.tolist() + [10] + string[::-1].tolist()
        assert (row_ids[2 * n + 1 :] == data.PAD).all()
        assert row_targets[: 2 * n].tolist() == row_ids[1 : 2 * n + 1].tolist()
        assert np.flatnonzero(row_mask).tolist() == list(range(n, 2 * n))
        assert row_targets[row_mask == 1].tolist() == string[::-1].tolist()


def test_prompts_and_exact_match_by_hand():
    strings = [np.array([1, 2, 3]), np.array([4, 5])]
    prompt, lengths = data.prompts(strings)
    assert prompt.tolist() == [[1, 2, 3, 10], [4, 5, 10, 11]]
    assert lengths.tolist() == [4, 3]
    tokens = np.array(
        [
            [1, 2, 3, 10, 3, 2, 1, 7, 7],  # right, then anything
            [4, 5, 10, 5, 5, 0, 0, 0, 0],  # wrong second letter
        ]
    )
    assert data.answers_correct(tokens, strings).tolist() == [True, False]


def test_parse_lengths():
    assert data.parse_lengths("3-8,11-12") == (3, 4, 5, 6, 7, 8, 11, 12)
    assert data.parse_lengths("9") == (9,)
    with pytest.raises(ValueError, match="between 1 and 12"):
        data.parse_lengths("3-13")
    with pytest.raises(ValueError, match="like '3-8'"):
        data.parse_lengths("three")


# -- the scripts at reduced size -----------------------------------------------------------


def run_script(name: str, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, str(EXPERIMENTS / name), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, f"{name} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.mark.experiment
def test_rope_check_script(tmp_path):
    run_script("rope_check.py", "--out", str(tmp_path))
    result = json.loads((tmp_path / "rope_check.json").read_text())
    assert (tmp_path / "rope_check.png").stat().st_size > 10_000
    for dim in (2, 32):
        r = result[f"dim{dim}"]
        assert r["pairs"] == 64 * 65 // 2 == 2080
        # The relative property: equal up to float32 rounding of values of size ~dim.
        assert abs(r["dot_5_2"] - r["dot_40_37"]) < 1e-5 * dim
        assert r["spread"] < 1e-5 * dim
        # The float64 reference (NumPy, from the rotation matrix) is exact to ~1e-14, and
        # eqrope agrees with it to float32 accuracy.
        assert r["spread_float64_reference"] < 1e-12
        assert r["max_abs_diff_vs_float64_reference"] < 1e-5 * dim


@pytest.mark.experiment
def test_reversal_script_learns_and_reloads(tmp_path):
    out, checkpoints = tmp_path / "out", tmp_path / "ckpt"
    common = ["--name", "ci", "--seeds", "0", "--n-test", "40", "--cache-prompts", "40",
              "--out", str(out), "--checkpoints", str(checkpoints)]
    # The full run uses lr 1e-3 over 1,500 steps; a 300-step run learns faster with 3e-3.
    run_script("reversal.py", "--steps", "300", "--lr", "3e-3", *common)
    result = json.loads((out / "reversal_ci.json").read_text())
    assert set(result["runs"]) == {"rotary", "learned"}
    assert (out / "reversal_ci.png").stat().st_size > 10_000
    assert "| 3-8 | **all** | 40 |" in (out / "reversal_ci.md").read_text()
    for kind, params in (("rotary", 101_644), ("learned", 103_244)):
        (run,) = result["runs"][kind]
        assert run["params"] == params
        assert (checkpoints / "ci" / f"{kind}_seed0" / "model.safetensors").is_file()
        seen = run["tests"]["3-8"]
        assert sum(c[1] for c in seen["by_length"].values()) == seen["total"] == 40
        # Chance is 1/10 per answer letter (uniform letters) and 10^-L per string. This
        # exact run gave letter accuracy 0.85 (rotary) and 0.97 (learned), and 26 and 35
        # of 40 exact answers. Copying the string forwards, or guessing any letter that
        # occurs in it, scores at most ~0.4 on lengths 3-8, so > 0.5 needs the reversal.
        assert seen["letter_accuracy"] > 0.5
        assert seen["correct"] >= 4  # 10% exact matches; chance is below 1e-3
        # The cache must not change a single greedy token.
        assert run["cache_equal"] == [40, 40]

    # --load skips training and must give the same answers on the same test strings.
    run_script("reversal.py", "--load", "--models", "rotary", "--name", "ci", "--seeds", "0",
               "--n-test", "40", "--cache-prompts", "0", "--out", str(tmp_path / "reloaded"),
               "--checkpoints", str(checkpoints))
    reloaded = json.loads((tmp_path / "reloaded" / "reversal_ci.json").read_text())
    assert reloaded["settings"]["loaded"] is True
    assert reloaded["runs"]["rotary"][0]["tests"] == result["runs"]["rotary"][0]["tests"]
