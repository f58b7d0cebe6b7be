"""Issue 32 ("Nothing silent, round 4"), the scoring part, and issue 33's items on eval/.

Each test is named for its defect and pins `eqrope.score` or `eqrope.eval.LM` against
something independent: the same tokens scored without `prefix=` (and a NumPy
`log_softmax` of the model's logits), each row scored alone with its own adapter,
lm-eval's own `hf` model on one checkpoint, lm-eval's own command-line config.
"""

import importlib.util
import itertools
import logging
import sys

import jax
import numpy as np
import pytest

import eqrope
from _adapters import adapted, base, call
from _models import random_model


MAX_LEN = 32


def _log_softmax(logits):
    logits = np.asarray(logits, np.float64)
    top = logits.max(axis=-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(axis=-1, keepdims=True))


# -- B1: a shared prefix on an unstacked model --------------------------------------------------


@pytest.fixture(scope="module")
def layouts():
    # One block compiles fastest; the reproducer's test below has two.
    model = random_model(0, 50, 32, 4, 1, MAX_LEN, n_kv_heads=2)
    return {"stacked": model, "unstacked": model.unstacked()}


# (prefix length, longest row): the prefix's bucket (0, 16, 32) and the rows' (8, 16, 32),
# whose sum passes the cache's 32 rows or not, with totals up to max_len and max_len + 1.
# Six pairs of buckets, one program each, per layout.
SPLITS = [
    (1, 32), (2, 31), (2, 8), (9, 24), (9, 8), (16, 17), (16, 16),
    (17, 16), (17, 9), (18, 15), (18, 8), (24, 9), (24, 8), (31, 2), (32, 1),
]  # fmt: skip


def test_b1_a_shared_prefix_scores_as_the_whole_text_in_both_layouts(layouts):
    rng = np.random.default_rng(1)
    checked = 0
    for p, longest in SPLITS:
        prefix = rng.integers(0, 50, p)
        lengths = np.asarray([1, max(1, longest - 1), longest])  # three rows: one width
        rows = rng.integers(0, 50, (len(lengths), longest))
        whole = np.concatenate([np.broadcast_to(prefix, (len(lengths), p)), rows], axis=1)
        # The reference: each row with the prefix written in, in one plain pass (no cache).
        alone = eqrope.score(layouts["stacked"], whole, p, p + lengths)
        for layout, model in layouts.items():
            shared = eqrope.score(model, rows, 0, lengths, prefix=prefix)
            got = shared.logprobs
            np.testing.assert_allclose(
                got, alone.logprobs[:, p:], atol=2e-5, err_msg=f"{layout}, {p} + {longest}"
            )
            np.testing.assert_array_equal(shared.all_greedy, alone.all_greedy)
            checked += 1
    assert checked == 2 * len(SPLITS)
    # The plain pass itself against NumPy, on a row that fills the context (17 + 16).
    p, n = 17, 16
    ids = rng.integers(0, 50, p + n)
    logits = call(layouts["unstacked"], ids[:-1])
    by_hand = _log_softmax(logits)[np.arange(p - 1, p + n - 1), ids[p:]]
    for model in layouts.values():
        shared = eqrope.score(model, ids[p:], 0, prefix=ids[:p])
        np.testing.assert_allclose(shared.logprobs, by_hand, atol=2e-5)


def test_b1_the_reproducer(layouts):
    """`probe-r4/b1_prefix_unstacked.py`: max_len 16, a prefix of 10 and a row of 7."""
    model = random_model(0, 50, 32, 4, 2, 16, n_kv_heads=2)
    prefix, row = np.arange(1, 11), np.arange(20, 27)
    whole = np.concatenate([prefix, row])
    expected = eqrope.score(model, whole, 10).logprobs[10:]
    for m in (model, model.unstacked()):
        got = eqrope.score(m, row[None], 0, [7], prefix=prefix).logprobs[0]
        np.testing.assert_allclose(got, expected, atol=2e-5)


# -- B2: adapters chosen per row, in every ragged order -----------------------------------------


@pytest.mark.parametrize("layout", ["stacked", "unstacked"])
def test_b2_each_row_scores_with_its_own_adapter_in_every_order(layout):
    model = base().with_layout(layout)
    three = [adapted(seed=s, targets=("v", "o"), model=model) for s in range(3)]
    many = eqrope.stack_adapters(three)
    assignment = [2, 0, 1]
    chosen = eqrope.select_adapters(many, assignment)
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, 53, (3, 9))
    prefix = rng.integers(0, 53, 5)
    for order in itertools.permutations([3, 6, 9]):
        lengths = np.asarray(order)
        alone = [eqrope.score(three[k], tokens[i, : lengths[i]]) for i, k in enumerate(assignment)]
        got = eqrope.score(chosen, tokens, 1, lengths)
        for row in range(3):
            np.testing.assert_allclose(
                got.logprobs[row, : lengths[row]], alone[row].logprobs, atol=2e-5, err_msg=order
            )
        # Passes of two rows (the last padded), rolling windows (several pieces of a row,
        # longest first), and a prefix (then not shared).
        split = eqrope.score(chosen, tokens, 1, lengths, batch_size=2)
        np.testing.assert_allclose(split.total, [a.total for a in alone], atol=2e-5)
        rolled = eqrope.score(chosen, tokens, 1, lengths, window=4, stride=2)
        for row, k in enumerate(assignment):
            own = eqrope.score(three[k], tokens[row, : lengths[row]], window=4, stride=2)
            np.testing.assert_allclose(rolled.total[row], own.total, atol=2e-5)
        with_prefix = eqrope.score(chosen, tokens, 0, lengths, prefix=prefix)
        for row, k in enumerate(assignment):
            whole = np.concatenate([prefix, tokens[row, : lengths[row]]])
            written_in = eqrope.score(three[k], whole, len(prefix))
            np.testing.assert_allclose(with_prefix.total[row], written_in.total, atol=2e-5)
    # One adapter id per row of tokens, or a clear refusal.
    with pytest.raises(ValueError, match=r"chosen for 3 rows .* tokens has 2"):
        eqrope.score(chosen, tokens[:2])


# -- B12: arguments that NumPy refused in its own words -----------------------------------------


def test_b12_huge_lengths_and_ragged_rows_are_refused_by_name(layouts):
    model = layouts["stacked"]
    tokens = np.arange(1, 6)
    for name in ("lengths", "prompt_lengths"):
        for value in (2**40, [2**40], np.int64(2**40)):
            with pytest.raises(ValueError, match=rf"^{name} holds integers outside the int32"):
                eqrope.score(model, tokens, **{name: value})
    with pytest.raises(ValueError, match=r"^tokens is a ragged list .* lengths="):
        eqrope.score(model, [[1, 2, 3], [4, 5]])
    with pytest.raises(ValueError, match=r"^prefix is a ragged list"):
        eqrope.score(model, tokens, prefix=[[1, 2], [3]])


# -- issue 33 item 1: a line when score compiles, none when it reuses the program ---------------


def test_issue33_item1_score_logs_each_compile_once(caplog):
    model = random_model(3, 37, 16, 2, 1, 16)  # a shape no other test compiles
    tokens = np.arange(1, 9)
    for kwargs in ({}, {"prefix": np.arange(3, 7)}):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="eqrope"):
            eqrope.score(model, tokens, **kwargs)
        lines = [r.getMessage() for r in caplog.records if r.name == "eqrope.eval"]
        assert len(lines) == 1 and lines[0].startswith("compiling score: "), lines
        assert "compiles once; later calls reuse it" in lines[0]
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="eqrope"):
            eqrope.score(model, tokens, **kwargs)
        assert not [r for r in caplog.records if r.name.startswith("eqrope")]


# -- lm-eval: B1 through LM.loglikelihood, B14, issue 33 item 10 --------------------------------

needs_lm_eval = pytest.mark.skipif(
    importlib.util.find_spec("lm_eval") is None, reason='needs lm-eval: pip install "eqrope[eval]"'
)
if importlib.util.find_spec("lm_eval") is not None:
    import eqrope.eval
    from test_lm_eval import _records, checkpoint, models, ours  # noqa: F401 (fixtures; offline is conftest's)


@needs_lm_eval
@pytest.mark.hf
def test_b1_lm_loglikelihood_of_an_unstacked_model_agrees_with_hf(checkpoint, models):
    from lm_eval.api.instance import Instance

    _, theirs = models
    unstacked = eqrope.eval.LM(
        pretrained=eqrope.from_hf(str(checkpoint), layout="unstacked"),
        tokenizer=str(checkpoint),
        batch_size=4,
    )
    story = " ".join(f"{r['prompt']} {r['target']}." for r in _records("until.jsonl") * 2)
    assert len(unstacked.tok_encode(story)) > 64  # cut on the left to max_length + 1 tokens
    pairs = [(story, " blue"), (story, " green and the sun is yellow"), ("The sky is", " blue")]
    pairs += [(story[: len(story) // 3], " mat")]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    got = unstacked.loglikelihood(requests, disable_tqdm=True)
    expected = theirs.loglikelihood(requests, disable_tqdm=True)
    np.testing.assert_allclose([g[0] for g in got], [e[0] for e in expected], atol=1e-4)
    assert [g[1] for g in got] == [e[1] for e in expected]


@needs_lm_eval
@pytest.mark.hf
def test_b14_an_empty_until_string_stops_after_one_token_as_hf(models):
    from lm_eval.api.instance import Instance

    ours_lm, theirs = models
    settings = [{"until": [""], "max_gen_toks": 6}, {"until": ["", "\n"], "max_gen_toks": 6}]
    requests = [
        Instance("generate_until", {}, (prompt, s), i)
        for i, (prompt, s) in enumerate(itertools.product(["The sky is", "One, two,"], settings))
    ]
    got = ours_lm.generate_until(requests, disable_tqdm=True)
    assert got == theirs.generate_until(requests, disable_tqdm=True)
    assert all(len(ours_lm.tok_encode(text, add_special_tokens=False)) <= 1 for text in got)


@needs_lm_eval
@pytest.mark.hf
def test_b2_lm_refuses_adapters_chosen_per_row_and_bad_arguments_by_name(checkpoint):
    model = eqrope.from_hf(str(checkpoint))
    two = [
        eqrope.lora(model, rank=2, targets=("v",), key=jax.random.key(s)) for s in range(2)
    ]
    chosen = eqrope.select_adapters(eqrope.stack_adapters(two), [0, 1])
    with pytest.raises(ValueError, match=r"chosen per row .* eqrope.take_adapter"):
        eqrope.eval.LM(pretrained=chosen, tokenizer=str(checkpoint))
    with pytest.raises(ValueError, match=r"^prefix_token_id=1000000 is outside"):
        eqrope.eval.LM(pretrained=str(checkpoint), prefix_token_id=10**6)
    with pytest.raises(TypeError, match="add_bos_token"):
        eqrope.eval.LM(pretrained=str(checkpoint), add_bos_token="yes")


@needs_lm_eval
def test_issue33_item10_the_command_line_reports_the_batch_size_it_uses(monkeypatch):
    """lm-eval prints (and writes) `batch_size: {cfg.batch_size}` of its own config: it must
    be `--model_args`' batch size, which the run uses."""
    harness = pytest.importorskip("lm_eval._cli")
    from lm_eval.config.evaluate_config import EvaluatorConfig

    import lm_eval.__main__
    from eqrope.eval.__main__ import main

    seen = []

    def cli_evaluate():  # lm-eval's own, up to the run: its parser and its config
        seen.append(EvaluatorConfig.from_cli(harness.HarnessCLI().parse_args()).batch_size)

    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", cli_evaluate)
    args = ["--model", "eqrope", "--model_args", "pretrained=/nowhere,batch_size=8", "-t", "x"]
    for extra in ([], ["--batch_size", "1"]):
        monkeypatch.setattr(sys, "argv", ["eqrope.eval", *args, *extra])
        main()
    monkeypatch.setattr(sys, "argv", ["eqrope.eval", "--model", "eqrope", "-t", "x", "-b", "4"])
    main()
    assert [str(b) for b in seen] == ["8", "8", "4"]
