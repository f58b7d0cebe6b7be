"""`eqrope.eval.LM` against lm-eval's own `hf` model, offline.

A tiny Llama is trained here with torch for a second on the tasks' own text (so that it
answers some questions greedily and stops at the `until` strings) and saved with
`save_pretrained` beside a byte-level BPE tokenizer trained with `tokenizers`; nothing is
downloaded (`HF_DATASETS_OFFLINE=1`, `HF_HUB_OFFLINE=1`). The tasks are the YAML files of
tests/data/lm_eval/, over JSON Lines files beside them. Both models run the same tasks
through `lm_eval.simple_evaluate` on the same directory, and every request is compared:
log-likelihoods within 1e-4, `is_greedy` equal, generated strings identical, metrics equal.

Needs lm-eval (`pip install eqrope[eval]`; the module is skipped without it), and for the
comparisons transformers, torch and accelerate (lm-eval's `hf` model imports it).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import eqrope


lm_eval = pytest.importorskip("lm_eval")

import eqrope.eval  # noqa: E402
from eqrope.eval._windows import rolling_windows  # noqa: E402


ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "tests" / "data" / "lm_eval"
MAX_LEN = 64  # the checkpoint's max_position_embeddings: lm-eval's max_length
TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ raise_exception('no system') }}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}</s>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _records(name: str) -> list[dict]:
    return [json.loads(line) for line in (TASKS / name).read_text().splitlines()]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A directory as transformers saves it: a 2-block Llama (64 wide, GQA, 64 positions)
    trained on two thirds of the tasks' answers, and its BPE tokenizer with a chat template."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    choice, until = _records("choice.jsonl"), _records("until.jsonl")
    texts = [f"Question: {r['question']}\nAnswer: {' '.join(r['choices'])}\n" for r in choice]
    texts += [f"{r['prompt']} {r['target']}.\n" for r in until]
    taught = [
        f"Question: {r['question']}\nAnswer: {r['choices'][r['answer']]}\n" for r in choice[:8]
    ]
    taught += [f"{r['prompt']} {r['target']}.\n" for r in until[:5]]
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer)
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)]
    )
    folder = tmp_path_factory.mktemp("tiny_llama")
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = TEMPLATE
    fast.save_pretrained(folder)
    config = transformers.LlamaConfig(
        vocab_size=backend.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_LEN,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # many threads on a tiny model only contend
    try:
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
        rows = [fast(t)["input_ids"] for t in taught]
        ids = torch.full((len(rows), max(map(len, rows))), 2)
        mask = torch.zeros_like(ids)
        for i, row in enumerate(rows):
            ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        for _ in range(100):
            loss = model(
                input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)
            ).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        model.eval().save_pretrained(folder)
    finally:
        torch.set_num_threads(threads)
    return folder


@pytest.fixture(scope="module")
def ours(checkpoint, offline):
    """eqrope's lm-eval model on the checkpoint, batch size 4."""
    return eqrope.eval.LM(pretrained=str(checkpoint), batch_size=4)


@pytest.fixture(scope="module")
def models(ours, checkpoint, offline):
    """(eqrope's model, lm-eval's `hf` model) on the checkpoint, batch size 4 each."""
    pytest.importorskip("accelerate")  # lm-eval's hf model imports it
    from lm_eval.models.huggingface import HFLM

    return ours, HFLM(pretrained=str(checkpoint), device="cpu", dtype="float32", batch_size=4)


@pytest.fixture(scope="module")
def evaluated(models):
    """`simple_evaluate` of both tasks on both models, with every sample logged."""
    from lm_eval.tasks import TaskManager

    # Our tasks alone: indexing lm-eval's thousands of built-in task files costs ~7 s of CPU.
    manager = TaskManager(include_path=str(TASKS), include_defaults=False)
    return [
        lm_eval.simple_evaluate(
            model=lm,
            tasks=["eqrope_choice", "eqrope_until"],
            task_manager=manager,
            log_samples=True,
            bootstrap_iters=0,
        )
        for lm in models
    ]


def _metrics(results: dict, task: str) -> dict:
    return {k: v for k, v in results["results"][task].items() if k not in ("name", "alias")}


@pytest.mark.hf
def test_multiple_choice_agrees_with_hf(evaluated, record_property):
    ours, theirs = evaluated
    pairs = list(
        zip(ours["samples"]["eqrope_choice"], theirs["samples"]["eqrope_choice"], strict=True)
    )
    assert len(pairs) == 12
    diffs, greedy = [], []
    for a, b in pairs:
        assert a["doc_id"] == b["doc_id"] and a["arguments"] == b["arguments"]
        for (ll_a, greedy_a), (ll_b, greedy_b) in zip(
            [r[0] for r in a["resps"]], [r[0] for r in b["resps"]], strict=True
        ):
            diffs.append(abs(ll_a - ll_b))
            assert greedy_a == greedy_b
            greedy.append(greedy_a)
    record_property("max_abs_loglikelihood_diff", max(diffs))
    print(f"48 requests: max |log-likelihood diff| = {max(diffs):.3g}")
    assert max(diffs) < 1e-4
    assert 0 < sum(greedy) < len(greedy)  # both kinds of answer were compared
    assert _metrics(ours, "eqrope_choice") == _metrics(theirs, "eqrope_choice")


@pytest.mark.hf
def test_generate_until_agrees_with_hf(evaluated):
    ours, theirs = evaluated
    samples = list(
        zip(ours["samples"]["eqrope_until"], theirs["samples"]["eqrope_until"], strict=True)
    )
    texts = [a["resps"][0][0] for a, _ in samples]
    assert texts == [b["resps"][0][0] for _, b in samples]
    assert _metrics(ours, "eqrope_until") == _metrics(theirs, "eqrope_until")
    # The taught prompts are answered and cut at the "." after the answer.
    targets = [" " + r["target"] for r in _records("until.jsonl")]
    assert sum(t == target for t, target in zip(texts[:5], targets)) >= 4


@pytest.mark.hf
def test_rolling_loglikelihood_agrees_with_hf(models, record_property):
    from lm_eval.api.instance import Instance

    ours, theirs = models
    story = " ".join(f"{r['prompt']} {r['target']}." for r in _records("until.jsonl"))
    text = " ".join([story] * 4)
    n = len(ours.tok_encode(text))
    assert n >= 3 * MAX_LEN
    texts = [text, story, "Grass is green."]
    requests = [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)]
    got = ours.loglikelihood_rolling(requests, disable_tqdm=True)
    expected = theirs.loglikelihood_rolling(requests, disable_tqdm=True)
    diff = max(abs(a - b) for a, b in zip(got, expected, strict=True))
    record_property("max_abs_rolling_diff", diff)
    print(f"rolling ({n} tokens, max_length {MAX_LEN}): max |diff| = {diff:.3g} of {got}")
    # float32 sums of hundreds of terms, in a different order on each side
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-4)


@pytest.mark.parametrize("max_len", [1, 4, 7, 64])
def test_rolling_windows_are_lm_evals(max_len):
    """`rolling_windows` with `stride = window` reads and scores what lm-eval's windows do."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    for n in range(1, 3 * max_len + 3):
        tokens = list(range(100, 100 + n))
        text = [7, *tokens]  # the prefix token, then the text
        theirs = []
        for context, continuation in map(
            make_disjoint_window,
            get_rolling_token_windows(tokens, prefix_token=7, max_seq_len=max_len, context_len=1),
        ):
            whole = (context + continuation)[-(max_len + 1) :]
            theirs.append((whole[:-1], continuation))
        ours = [
            (text[p.start : p.last], text[p.first : p.last + 1])
            for p in rolling_windows(0, len(text), 1, max_len, max_len)
        ]
        assert ours == theirs, n


def test_registered_beside_lm_evals_own_models():
    from lm_eval.api.registry import get_model

    assert get_model("eqrope") is eqrope.eval.LM
    assert get_model("hf").__name__ == "HFLM"  # the built-in models are still found


@pytest.mark.hf
def test_chat_template_and_tokenizer_name_as_hf(models):
    ours, theirs = models
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "The sky is"},
        {"role": "assistant", "content": "blue "},
    ]
    for history, prompt in ((chat[1:2], True), (chat[1:], False), (chat, True)):
        assert ours.apply_chat_template(history, prompt) == theirs.apply_chat_template(
            history, prompt
        )
    assert ours.chat_template(True) == theirs.chat_template(True) == TEMPLATE
    assert ours.tokenizer_name == theirs.tokenizer_name


@pytest.mark.hf
def test_auto_batch_size_gives_the_same_answers(checkpoint, ours):
    from lm_eval.api.instance import Instance

    # As the command line builds it: `--model_args` wins over `--batch_size`'s default of 1.
    auto = eqrope.eval.LM.create_from_arg_string(
        f"pretrained={checkpoint},batch_size=auto,max_batch_size=8",
        {"batch_size": 1, "max_batch_size": None, "device": "cpu"},
    )
    assert auto.batch_size == "auto" and auto.max_batch_size == 8
    requests = [
        Instance("loglikelihood", {}, ("Question: What is two plus two?\nAnswer:", f" {w}"), i)
        for i, w in enumerate(["three", "four", "five"])
    ]
    got = auto.loglikelihood(requests, disable_tqdm=True)
    expected = ours.loglikelihood(requests, disable_tqdm=True)
    np.testing.assert_allclose([g[0] for g in got], [e[0] for e in expected], atol=1e-5)
    assert [g[1] for g in got] == [e[1] for e in expected]
    (rows,) = auto.batch_sizes.values()
    assert rows in (1, 2, 4, 8)


@pytest.mark.hf
def test_sampling_follows_the_seed(checkpoint, ours):
    from lm_eval.api.instance import Instance

    settings = {"until": ["\n"], "max_gen_toks": 8, "do_sample": True, "temperature": 1.5}
    requests = [
        Instance("generate_until", {}, (p, settings), i)
        for i, p in enumerate(["Grass is", "Bees make"])
    ]
    first = eqrope.eval.LM(pretrained=str(checkpoint), seed=3).generate_until(
        requests, disable_tqdm=True
    )
    again = eqrope.eval.LM(pretrained=str(checkpoint), seed=3).generate_until(
        requests, disable_tqdm=True
    )
    assert first == again and all(isinstance(t, str) for t in first)
    with pytest.raises(ValueError, match="temperature > 0"):
        ours.generate_until(
            [
                Instance(
                    "generate_until", {}, ("Grass is", {"do_sample": True, "max_gen_toks": 8}), 0
                )
            ]
        )
    with pytest.raises(ValueError, match=r"\['num_beams'\]"):
        ours.generate_until(
            [Instance("generate_until", {}, ("Grass is", {"num_beams": 2, "max_gen_toks": 8}), 0)]
        )


@pytest.mark.hf
def test_bad_arguments_raise_clearly(checkpoint, ours):
    from lm_eval.api.instance import Instance

    with pytest.raises(TypeError, match=r"unknown arguments \['trust_remote_code'\]"):
        eqrope.eval.LM(pretrained=str(checkpoint), trust_remote_code=True)
    with pytest.raises(ValueError, match="max_length=65"):
        eqrope.eval.LM(pretrained=str(checkpoint), max_length=MAX_LEN + 1)
    with pytest.raises(ValueError, match="batch_size"):
        eqrope.eval.LM(pretrained=str(checkpoint), batch_size="many")
    with pytest.raises(ValueError, match="empty continuation"):
        ours.loglikelihood(
            [Instance("loglikelihood", {}, ("The sky is", ""), 0)], disable_tqdm=True
        )


@pytest.mark.hf
def test_command_line(checkpoint, offline, evaluated, tmp_path):
    """`python -m eqrope.eval` is lm-eval's command line with "eqrope" registered."""
    command = [
        sys.executable,
        "-m",
        "eqrope.eval",
        "--model",
        "eqrope",
        "--model_args",
        f"pretrained={checkpoint},dtype=float32,batch_size=4",
        "--tasks",
        "eqrope_choice",
        "--include_path",
        str(TASKS),
        "--output_path",
        str(tmp_path),
        "--device",
        "cpu",
    ]
    proc = subprocess.run(
        command,
        cwd=ROOT,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (written,) = tmp_path.rglob("results_*.json")
    result = json.loads(written.read_text())["results"]["eqrope_choice"]
    assert result["acc,none"] == evaluated[0]["results"]["eqrope_choice"]["acc,none"]
    assert "eqrope_choice" in proc.stdout
