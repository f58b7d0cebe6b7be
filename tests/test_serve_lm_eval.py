"""lm-eval's own API models against `python -m eqrope.serve`: `local-completions` on a
multiple-choice and a `generate_until` task, and `local-chat-completions` on the
`generate_until` task, compared request by request with lm-eval's `eqrope` model
(`eqrope.eval.LM`) on the same checkpoint: log-likelihoods within 1e-4, `is_greedy`
equal, generations equal. lm-eval reads the server's tokenizer through `/tokenize` and
`/tokenizer_info` (its remote tokenizer), so nothing is downloaded.

Needs the `[serve]` and `[eval]` extras (skipped without them).
"""

import pytest
from _serve import serve, write_checkpoint


lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

import eqrope.eval  # noqa: E402


TASKS = ["eqrope_choice", "eqrope_until"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("lm_eval_served"), max_len=128)


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    args = ("--slots", "4", "--max-len", "128", "--served-model-name", "tiny")
    with serve(checkpoint, *args, log_dir=tmp_path_factory.mktemp("logs")) as s:
        yield s


def evaluate(model, model_args, tasks, **kwargs) -> dict:
    from lm_eval.tasks import TaskManager

    # Our tasks alone: indexing lm-eval's thousands of built-in task files costs ~7 s of CPU.
    manager = TaskManager(include_path="tests/data/lm_eval", include_defaults=False)
    return lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=tasks, task_manager=manager, log_samples=True,
        bootstrap_iters=0, **kwargs,
    )  # fmt: skip


@pytest.fixture(scope="module")
def ours(checkpoint, offline):
    # lm-eval's API models encode without special tokens (its remote tokenizer sends
    # add_special_tokens=False): the eqrope model is asked to do the same.
    return evaluate(eqrope.eval.LM(pretrained=str(checkpoint), batch_size=4, add_bos_token=False), None, TASKS)


@pytest.fixture(scope="module")
def served(server, offline):
    args = {"model": "tiny", "base_url": server.url + "/v1/completions", "num_concurrent": 2, "max_retries": 1,
            "max_length": 128}  # fmt: skip
    return evaluate("local-completions", args, TASKS)


def responses(results: dict, task: str) -> list:
    return [(s["doc_id"], s["arguments"], s["resps"]) for s in results["samples"][task]]


def test_log_likelihoods_agree_with_the_eqrope_model(ours, served):
    a, b = responses(ours, "eqrope_choice"), responses(served, "eqrope_choice")
    assert len(a) == len(b) == 12
    diffs = []
    for (doc_a, args_a, resps_a), (doc_b, args_b, resps_b) in zip(a, b):
        assert doc_a == doc_b and args_a == args_b
        for (ll_a, greedy_a), (ll_b, greedy_b) in zip([r[0] for r in resps_a], [r[0] for r in resps_b], strict=True):
            diffs.append(abs(ll_a - ll_b))
            assert greedy_a == greedy_b
    assert max(diffs) < 1e-4, max(diffs)
    assert ours["results"]["eqrope_choice"]["acc,none"] == served["results"]["eqrope_choice"]["acc,none"]


def test_generations_equal_the_eqrope_model(ours, served):
    a, b = responses(ours, "eqrope_until"), responses(served, "eqrope_until")
    assert [r[2] for r in a] == [r[2] for r in b]
    assert len(a) == 8 and any(r[2][0][0] for r in a)  # some text was generated and compared


def test_chat_completions_generate_until_equals_the_eqrope_model(checkpoint, server, offline):
    """`local-chat-completions` sends the task's prompt as one user message; the server
    renders it with the checkpoint's chat template, as `--model eqrope` does with
    `--apply_chat_template`."""
    args = {"model": "tiny", "base_url": server.url + "/v1/chat/completions", "num_concurrent": 2,
            "max_retries": 1, "max_length": 128}  # fmt: skip
    chat = evaluate("local-chat-completions", args, ["eqrope_until"], apply_chat_template=True)
    lm = eqrope.eval.LM(pretrained=str(checkpoint), batch_size=4, add_bos_token=False)
    ours = evaluate(lm, None, ["eqrope_until"], apply_chat_template=True)
    a, b = responses(ours, "eqrope_until"), responses(chat, "eqrope_until")
    assert [r[2] for r in a] == [r[2] for r in b]
