"""bench/speculative.py and its task: the committed pair, the language, the JSON.

The language is checked against its grammar, the committed target against the copying
task itself (the text after the separator), and the benchmark's quick mode for every key
and for each derived figure against the raw counts it comes from. Timings are never
asserted.
"""

import json
import math
import statistics
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import eqrope
from _bench import BENCH, ROOT, SMOKE_ENV, load


task = load("_speculative_task")
trained = load("_speculative_pair")


def close(a, b):
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)


# -- the language -------------------------------------------------------------------------


def test_sentences_and_rows_come_from_the_grammar():
    grammar = task.make_grammar()
    rng = np.random.default_rng(3)
    for _ in range(200):
        assert task.is_sentence(task.sentence(grammar, rng))
    ids, targets, mask = task.training_batch(grammar, rng, 32)
    assert ids.shape == targets.shape == mask.shape == (32, task.TRAIN_LEN)
    assert ids.dtype == targets.dtype == np.int32 and mask.dtype == bool
    np.testing.assert_array_equal(ids[:, 1:], targets[:, :-1])
    copying = 0
    for row, last, keep in zip(ids, targets[:, -1], mask):
        string = task.decode(np.append(row, last))
        if "|" in string:  # a copying row: text|text, then sentences; the loss on the copy
            copying += 1
            copied, rest = string.split("|")
            assert task.is_text(copied) and len(copied) <= task.COPY_MAX
            assert rest.startswith(copied + " ")
            assert task.is_text(rest[len(copied) + 1 :], complete=False)
            # Targets kept: the copied characters and the space after them.
            assert task.decode(np.append(row, last)[1:][keep]) == copied + " "
        else:
            assert task.is_text(string, complete=False) and keep.all()
    assert 0 < copying < 32
    _, _, mask = task.training_batch(grammar, rng, 8, copy_fraction=0.0)
    assert mask.all()


def test_membership_checks_reject():
    assert task.is_sentence("the cat sees a dog.")
    assert not task.is_sentence("a big man paints my quiet tree near the river.")  # a place
    assert task.is_sentence("the cat sees a dog near the park.")
    assert not task.is_sentence("the cat sees a dog")
    assert not task.is_sentence("the cat sees dog.")
    assert task.is_sentence("the cat se", complete=False)
    assert task.is_sentence("the ", complete=False)
    assert not task.is_sentence("the cat xe", complete=False)
    assert not task.is_sentence("the cat cat ", complete=False)
    assert task.is_text("the cat sees a dog. my king eats the fish.")
    assert not task.is_text("the cat sees a dog.  my king eats the fish.")


def test_prompts_are_deterministic_and_from_the_grammar():
    prompt, lengths = task.language_prompts(8)
    again, lengths_again = task.language_prompts(8)
    np.testing.assert_array_equal(prompt, again)
    np.testing.assert_array_equal(lengths, lengths_again)
    assert prompt.dtype == lengths.dtype == np.int32 and prompt.shape == (8, lengths.max())
    for row, n in zip(prompt, lengths):
        string = task.decode(row[:n])
        assert string.endswith(" ") and task.is_sentence(string, complete=False)
    prompt, lengths, texts = task.copy_prompts(8, given=2)
    assert prompt.dtype == lengths.dtype == np.int32
    for row, n, t in zip(prompt, lengths, texts):
        assert task.decode(row[:n]) == t + "|" + t[:2]
        assert task.is_text(t) and len(t) <= task.COPY_MAX


def test_entropy_per_char_against_a_sample():
    """The exact rate against the sample mean of -log p(sentence) per character."""
    grammar = task.make_grammar()
    rng = np.random.default_rng(0)
    chars = np.mean([len(task.sentence(grammar, rng)) + 1 for _ in range(20_000)])
    rate = task.entropy_per_char(grammar)
    assert 0.3 < rate < 0.4
    assert abs(rate * chars / 11.1876 - 1) < 0.01  # nats per sentence, by hand from the tables


# -- the committed pair ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair():
    return trained.load_pair()


def test_committed_pair_loads(pair):
    target, draft = pair
    assert target.config.vocab_size == draft.config.vocab_size == task.VOCAB_SIZE
    assert (target.config.d_model, target.config.n_blocks) == (256, 4)
    assert (draft.config.d_model, draft.config.n_blocks) == (64, 1)
    assert target.embed.dtype == draft.embed.dtype == jnp.float32


def test_missing_pair_says_how_to_train(tmp_path):
    with pytest.raises(FileNotFoundError, match="bench/speculative.py --train"):
        trained.load_pair(tmp_path)


def test_target_copies_after_the_separator(pair):
    """Greedy plain generate writes each prompt's text after the separator."""
    target, _ = pair
    prompt, lengths, texts = task.copy_prompts(8, seed=11, given=0)
    new = max(len(t) for t in texts)
    tokens = np.asarray(eqrope.generate(target, jnp.asarray(prompt), new,
                                        prompt_lengths=jnp.asarray(lengths)))
    copied = [task.decode(row[n : n + len(t)]) for row, n, t in zip(tokens, lengths, texts)]
    assert copied == texts


def test_target_continues_in_the_language(pair):
    target, _ = pair
    prompt, lengths = task.language_prompts(4, seed=5)
    tokens = np.asarray(eqrope.generate(target, jnp.asarray(prompt), 40,
                                        prompt_lengths=jnp.asarray(lengths)))
    for row, n in zip(tokens, lengths):
        assert task.is_text(task.decode(row[: n + 40]), complete=False)


# -- the benchmark's quick mode ---------------------------------------------------------------


def check_timing(t, repeats):
    assert len(t["times_s"]) == repeats == t["repeats"]
    assert close(t["median_s"], statistics.median(t["times_s"]))
    assert t["min_s"] == min(t["times_s"]) and t["max_s"] == max(t["times_s"])
    assert set(t["first_compile"]) == {"trace_s", "lower_s", "compile_s"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("speculative")
    command = [sys.executable, str(BENCH / "speculative.py"), "--quick", "--out", str(out)]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          check=False, env=SMOKE_ENV)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "speculative_cpu.json").read_text()), proc.stdout


@pytest.mark.experiment
def test_quick_bench_is_consistent(run):
    data, stdout = run
    assert data["mode"] == "quick"
    for key in ("cpu_model", "cpu_count", "jax", "jaxlib", "equinox", "numpy", "date", "backend"):
        assert data["machine"][key] not in (None, "")
    sizes = data["sizes"]
    cases = {(c["case"], c["draft_len"], c["batch"]): c for c in data["cases"]}
    expected = {(name, k, b) for name in ("draft", "prompt_lookup") for k in sizes["ks"]
                for b in sizes["batches"]}
    expected |= {("self", sizes["k"], b) for b in sizes["batches"]}
    expected |= {("draft, sampling", sizes["k"], sizes["sampling_batch"])}
    assert set(cases) == expected and len(data["cases"]) == len(expected)
    for c in data["cases"]:
        rows = c["rows"]
        assert len(rows["target_steps"]) == c["batch"]
        for path in ("plain", "speculative"):
            check_timing(c[path], sizes["repeats"])
            assert close(c["compile_s"][path], c[path]["first_s"] - c[path]["median_s"])
        for key in ("new_tokens", "drafted", "accepted", "target_steps", "plain_target_steps"):
            assert c[key] == sum(rows[key])
        assert all(0 <= a <= d for a, d in zip(rows["accepted"], rows["drafted"]))
        assert c["drafted"] > 0 and close(c["acceptance"], c["accepted"] / c["drafted"])
        assert close(c["target_steps_per_token"], c["target_steps"] / c["new_tokens"])
        assert rows["plain_target_steps"] == rows["plain_new_tokens"]  # one step per token
        assert c["plain_target_steps_per_token"] == 1.0
        assert close(c["speedup"], c["plain"]["median_s"] / c["speculative"]["median_s"])
        # Each round writes its accepted drafts and one token of the target's, but the
        # last round's target token may fall past max_new.
        for n, a, steps in zip(rows["new_tokens"], rows["accepted"], rows["target_steps"]):
            assert a + steps - 1 <= n <= a + steps
        if c["temperature"] == 0:
            assert c["identical_tokens"] is True
            assert rows["new_tokens"] == rows["plain_new_tokens"]
            assert all(n == c["max_new"] for n in rows["new_tokens"])
        else:
            assert c["identical_tokens"] is None
    for b in sizes["batches"]:
        own = cases[("self", sizes["k"], b)]
        assert own["bound"] == math.ceil(own["max_new"] / (sizes["k"] + 1)) + 1
        assert own["within_bound"] is (max(own["rows"]["target_steps"]) <= own["bound"])
        assert own["within_bound"] is True
        lookup = cases[("prompt_lookup", sizes["k"], b)]
        assert lookup["plain_copies"] == 1.0
    assert "speedup" in stdout and "wrote" in stdout
