"""Issue 33, "The newcomer's path": what a new user meets first says what is going on.

One test (or a few) per item of the issue: the compile log lines (1), the checks at the
door of `generate_text` (2), the bench's word for a target not met (3), the README's
setup, test times and torch index (4, 6), the training loop of docs/index.md (5), the
reprs (8; the types are tests/test_types.py), transformers' keywords (9), the truncation
warning (10), messages that name the fix (11), the docs' navigation (12), and the docs
run from a temporary folder.
"""

import importlib.util
import json
import logging
import pathlib
import re
import subprocess
import sys
import warnings

import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tokenizers
from _bench import ROOT, load
from _models import random_model
from tokenizers import models, pre_tokenizers

import eqrope


README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"
# Sizes no other test module uses, so that this module's programs compile here.
VOCAB, MAX_LEN = 23, 32
WORDS = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran"]


@pytest.fixture(scope="module")
def model():
    return random_model(0, VOCAB, 16, 2, 1, MAX_LEN)


def raw_tokenizer(words=WORDS) -> tokenizers.Tokenizer:
    """A word-level `tokenizers.Tokenizer`: `<unk>` 0, `</s>` 1, then `words`."""
    vocab = {w: i for i, w in enumerate(["<unk>", "</s>", *words])}
    raw = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    return raw


def eqrope_messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("eqrope")]


# -- 1. compiles are logged when a program is traced -----------------------------------------


def test_first_generate_logs_its_compile_once(caplog, monkeypatch):
    # As in a fresh process: no generate program compiled before this test's.
    monkeypatch.setattr("eqrope.generation._compile_lines._SEEN", {})
    fresh = random_model(1, 29, 16, 2, 1, MAX_LEN)  # used by no other test: it compiles here
    caplog.set_level(logging.INFO, logger="eqrope")
    prompt = np.arange(5, dtype=np.int32)
    eqrope.generate(fresh, prompt, 7)
    assert eqrope_messages(caplog) == [
        "compiling generate: batch 1, cache length 16 (a new batch, cache length, "
        "num_samples or static setting compiles once; later calls reuse it)"
    ]
    assert caplog.records[-1].name == "eqrope.generation"
    caplog.clear()
    eqrope.generate(fresh, prompt, 7)  # the same call: nothing compiles, nothing is logged
    eqrope.generate(fresh, prompt[:3], 9)  # a new prompt and max_new in the same 16 rows
    assert eqrope_messages(caplog) == []
    eqrope.generate(fresh, prompt, 20)  # 25 positions: a new cache length, 32
    assert eqrope_messages(caplog) == [
        "compiling generate: batch 1, cache length 32; new: cache length 16 -> 32 (a new "
        "combination of these compiles once; later calls reuse it)"
    ]


def test_train_step_logs_its_compile_once(caplog):
    model = random_model(2, 31, 16, 2, 1, 16)
    optimizer = optax.sgd(1e-2)
    step, opt_state = eqrope.make_train_step(optimizer), eqrope.init_optimizer(optimizer, model)
    ids = jnp.zeros((2, 8), jnp.int32)
    caplog.set_level(logging.INFO, logger="eqrope")
    for _ in range(2):
        model, opt_state, _ = step(model, opt_state, ids, ids, ids >= 0)
    assert eqrope_messages(caplog) == [
        "compiling the train step: int32[2,8], int32[2,8], bool[2,8] (a new batch shape or "
        "dtype compiles once; later calls reuse it)"
    ]
    assert caplog.records[-1].name == "eqrope.training"


def test_the_library_logs_quietly():
    """A NullHandler on "eqrope", and nothing configured on the root logger."""
    assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger("eqrope").handlers)
    code = "import logging, eqrope; print(logging.getLogger().handlers, logging.getLogger().level)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == ["[]", str(logging.WARNING)], proc.stderr


# -- 2. easy slips are caught at the door of generate_text -----------------------------------


def test_generate_text_refuses_a_raw_tokenizers_tokenizer(model):
    with pytest.raises(TypeError, match="not an eqrope.Tokenizer") as info:
        eqrope.generate_text(model, raw_tokenizer(), "the cat", 3)
    message = str(info.value)
    assert "eqrope.Tokenizer.from_pretrained(path)" in message
    assert "eqrope.Tokenizer(tokenizers_obj" in message
    # What the message says works.
    text = eqrope.generate_text(model, eqrope.Tokenizer(raw_tokenizer(), eos_ids=(1,)), "the cat", 3)
    assert isinstance(text, str)


def test_generate_text_refuses_chat_messages(model):
    tokenizer = eqrope.Tokenizer(raw_tokenizer())
    chat = [{"role": "user", "content": "the cat"}]
    fix = "tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)"
    for prompt in (chat, [chat], chat[0]):
        with pytest.raises(TypeError, match="chat messages") as info:
            eqrope.generate_text(model, tokenizer, prompt, 3)
        assert fix in str(info.value)
    with pytest.raises(TypeError, match="for token ids use eqrope.generate"):
        eqrope.generate_text(model, tokenizer, [3, 4, 5], 3)


# -- 3. the bench's targets not met are open goals, not failures -----------------------------


def test_bench_targets_not_met_read_as_open():
    report = load("_report")
    assert [report.verdict(m) for m in (True, False, None)] == ["met", "open (not yet met)", "not measured"]
    assert "not an error of the install" in report.TARGETS_NOTE
    for script in ("_report.py", "eval.py", "vs_transformers.py"):
        assert "MISSED" not in (ROOT / "bench" / script).read_text()
    assert "`open (not yet met)`" in README and "not a broken install" in README


# -- 4 and 6. the README: the venv, the test time, quicker subsets, torch's CPU index --------


def bash_commands(text: str) -> list[str]:
    """The commands of the first bash block of `text` (comments left out)."""
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_readme_gives_the_venv_the_test_time_and_quicker_subsets():
    assert "`python -m venv .venv && source .venv/bin/activate`" in README
    assert README.index("python -m venv .venv") < README.index('pip install -e ".[dev]"')
    assert 'pytest -m "not experiment"' in README and "`pytest -m quick`" in README
    # The figures themselves are checked against the measured run by tests/test_readme_path.py.
    skips = json.loads((ROOT / "tests" / "data" / "suite_figures.json").read_text())["skipped_without_extras"]
    assert f"{skips} tests skip" in README
    assert "minutes on 2 cores" in README


def test_readme_first_two_commands_are_what_ci_runs():
    assert bash_commands(README)[:2] == [
        'pip install -e ".[dev]" && python bench/kv_cache.py',
        'pip install -e ".[dev]" && pytest',
    ]
    ci = (ROOT / ".ci" / "run").read_text()
    for line in ("python3 -m venv .venv", "source .venv/bin/activate", 'pip install -e ".[dev]"'):
        assert line in ci
    assert "\npytest\n" in ci


def test_readme_installs_torch_from_pytorchs_cpu_index():
    index = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
    assert f"{index} && pip install -c constraints-hf.txt -e \".[hf,eval,serve]\"" in README
    assert "local CPU wheel" in README and "about 30 minutes" in README
    # CI's machines cannot reach PyTorch's index: their command stays as it was.
    assert "\npip install torch==2.13.0\n" in (ROOT / ".ci" / "run").read_text()


# -- 5. a minimal training loop in docs/index.md (run by the docs' own tests) ----------------


def test_index_page_trains_a_few_steps():
    index = (DOCS / "index.md").read_text()
    block = index.split("## Train it", 1)[1]
    for piece in ("optax.adam", "eqrope.init_optimizer(optimizer, model)",
                  "step = eqrope.make_train_step(optimizer)",
                  "model, opt_state, loss = step(model, opt_state, ids, targets, mask)",
                  ">>> losses[-1] < losses[0]\nTrue"):  # fmt: skip
        assert piece in block
    assert "eqrope.enable_logging()" in index  # eqrope's lines alone (issue 44, item 6)


# -- 8. reprs --------------------------------------------------------------------------------


def test_tokenizer_repr(tmp_path):
    raw = raw_tokenizer()
    raw.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    read = eqrope.Tokenizer.from_pretrained(tmp_path)
    assert repr(read) == (
        f"Tokenizer({str(tmp_path)!r}, vocab_size=10, eos_ids=(1,), pad_id=None, chat_template=none)"
    )
    made = eqrope.Tokenizer(raw_tokenizer(), chat_template="{{ messages }}")
    assert repr(made) == "Tokenizer(vocab_size=10, eos_ids=(), pad_id=None, chat_template=yes)"


def test_generation_repr_shows_the_draft_counters_only_with_a_draft(model):
    prompt = np.asarray([3, 4, 3, 4, 3], np.int32)
    plain = repr(eqrope.generate(model, prompt, 4, return_logprobs=True))
    assert plain.startswith("Generation(\n  tokens=i32[9],") and "lengths=i32[]" in plain
    assert "target_steps" not in plain and "drafted" not in plain and "accepted" not in plain
    drafted = repr(eqrope.generate(model, prompt, 4, return_logprobs=True, draft="prompt_lookup"))
    assert "target_steps=i32[]" in drafted and "drafted=i32[]" in drafted and "accepted=i32[]" in drafted


# -- 9. transformers' keywords name eqrope's -------------------------------------------------

HF_KEYWORDS = [
    ("max_new_tokens", 4, "eqrope's is max_new"),
    ("do_sample", True, "temperature > 0"),
    ("num_return_sequences", 2, "eqrope's is num_samples"),
    ("eos_token_id", 1, "eqrope's is eos_id"),
    ("pad_token_id", 0, "eqrope's is pad_id"),
    ("stop_strings", ["mat"], "eqrope's is stop"),
    ("num_beams", 4, "eqrope does not implement it"),
]


@pytest.mark.parametrize(("name", "value", "says"), HF_KEYWORDS)
def test_transformers_keywords_name_eqropes(model, name, value, says):
    prompt = np.arange(3, dtype=np.int32)
    tokenizer = eqrope.Tokenizer(raw_tokenizer())
    calls = {
        "generate": lambda: eqrope.generate(model, prompt, 4, **{name: value}),
        "generate_text": lambda: eqrope.generate_text(model, tokenizer, "the cat", 4, **{name: value}),
    }
    if name != "num_return_sequences":  # make_grpo_step's group_size
        calls["make_grpo_step"] = lambda: eqrope.make_grpo_step(
            optax.sgd(1e-2), lambda tokens, lengths, ends: tokens, group_size=2, max_new=4, **{name: value}
        )
    for who, call in calls.items():
        with pytest.raises(TypeError, match=re.escape(f"{who}() got {name}=")) as info:
            call()
        assert says in str(info.value) and "docs/generation.md" in str(info.value)
    assert f"`{name}" in (DOCS / "generation.md").read_text()  # the table the message names


def test_generate_refuses_an_unknown_keyword_as_python_does(model):
    with pytest.raises(TypeError, match=re.escape("generate() got an unexpected keyword argument 'colour'")):
        eqrope.generate(model, np.arange(3, dtype=np.int32), 4, colour="blue")


# -- 10. a max_new that does not fit warns ---------------------------------------------------


def test_generate_warns_when_max_new_does_not_fit(model):
    prompt = np.arange(5, dtype=np.int32)
    with pytest.warns(eqrope.TruncationWarning) as record:
        out = eqrope.generate(model, prompt, 40)
    assert str(record[0].message) == (
        "generate: max_new=40, but the model's max_len (32) holds 27 new tokens after the "
        "prompt of 5, so 13 will not be generated. Pass max_new <= 27 to silence this."
    )
    assert record[0].filename == __file__  # it points at the caller's line
    assert out.shape == (MAX_LEN,)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert eqrope.generate(model, prompt, 27).shape == (MAX_LEN,)  # fits: no warning
    batch = np.zeros((2, 9), np.int32)
    cut = "max_len=16 holds 7 new tokens after the longest prompt of 9"
    with pytest.warns(eqrope.TruncationWarning, match=re.escape(cut)):
        eqrope.generate(model, batch, 8, prompt_lengths=[9, 4], max_len=16)


def test_generate_text_warns_at_its_caller(model):
    tokenizer = eqrope.Tokenizer(raw_tokenizer())
    with pytest.warns(eqrope.TruncationWarning, match="max_new=40") as record:
        eqrope.generate_text(model, tokenizer, "the cat sat", 40)
    assert record[0].filename == __file__


# -- 11. messages that name the fix ----------------------------------------------------------


def test_a_hub_id_says_that_eqrope_does_not_download(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="eqrope does not download") as info:
        eqrope.Tokenizer.from_pretrained("HuggingFaceTB/SmolLM2-135M")
    assert "huggingface_hub.snapshot_download('HuggingFaceTB/SmolLM2-135M')" in str(info.value)


def test_a_tokenizer_larger_than_the_model_names_both_sizes(model):
    big = eqrope.Tokenizer(raw_tokenizer([f"w{i}" for i in range(30)]))
    with pytest.raises(ValueError, match="the tokenizer has 32 token ids but the model's vocab_size is 23"):
        eqrope.generate_text(model, big, "w1 w2", 3)


# -- 12. navigation --------------------------------------------------------------------------


def test_every_docs_page_is_linked_from_the_index_and_the_readme():
    pages = sorted(p.name for p in DOCS.glob("*.md"))
    index = (DOCS / "index.md").read_text()
    assert [p for p in pages if p != "index.md" and f"]({p})" not in index] == []
    assert [p for p in pages if f"](docs/{p})" not in README] == []


# -- the docs run outside the checkout -------------------------------------------------------


def docs_conftest():
    spec = importlib.util.spec_from_file_location("docs_conftest_of_the_tests", DOCS / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_pages_run_outside_the_checkout(tmp_path):
    """docs/conftest.py runs each page in a temporary folder of its own, where a block that
    reads a file of the checkout by a relative path fails; the folder goes afterwards."""
    conftest = docs_conftest()
    page = tmp_path / "page.md"
    page.write_text(
        "```python\n>>> from pathlib import Path\n"
        f">>> print(Path.cwd() not in (Path(r'{ROOT}'), Path(r'{tmp_path}')))\nTrue\n"
        ">>> print(Path('README.md').read_text()[:8])\n# eqrope\n\n```\n"
    )
    document = conftest._sybil(conftest._elsewhere, path=str(tmp_path), patterns=["*.md"]).parse(page)
    outcomes = []
    conftest._elsewhere(document.namespace)
    try:
        for example in document:
            try:
                example.evaluate()
                outcomes.append("passed")
            except Exception as error:  # noqa: BLE001 (sybil's failure, or the block's)
                outcomes.append("No such file or directory: 'README.md'" in str(error))
    finally:
        folder = pathlib.Path(document.namespace["_folder"])
        conftest._teardown(document.namespace)
    assert outcomes == ["passed", "passed", True]
    assert not folder.exists()


def test_every_docs_page_runs_outside_the_checkout():
    # A page that must read the checkout by a relative path would be listed here.
    assert docs_conftest().FROM_CHECKOUT == {}


def test_save_and_to_hf_with_the_arguments_swapped_say_the_order(tmp_path):
    """Item 11: `save(model, path)` names the order, `save(path, model)`, and so does
    `to_hf(path, model)` (its order is `to_hf(model, path)`). Run without the test
    session's type-check hook, which would refuse the path first."""
    script = (
        "import jax, eqrope, sys\n"
        "m = eqrope.RotaryDecoder(13, 16, 2, 1, 8, key=jax.random.PRNGKey(0))\n"
        "for f, args in ((eqrope.save, (m, sys.argv[1])), (eqrope.to_hf, (sys.argv[1], m))):\n"
        "    try:\n"
        "        f(*args)\n"
        "    except TypeError as e:\n"
        "        print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "ckpt")], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert len(out) == 2 and not (tmp_path / "ckpt").exists()
    assert out[0].startswith("eqrope.save(path, model) takes the directory first and the model second")
    assert out[1].startswith("eqrope.to_hf(model, path) takes the model first and the directory second")
    assert f"Call eqrope.save({str(tmp_path / 'ckpt')!r}, model)." in out[0]


def test_the_quick_subset_names_modules_that_exist():
    from _quick import QUICK

    tests = ROOT / "tests"
    assert QUICK and all((tests / name).is_file() for name in QUICK), sorted(n for n in QUICK if not (tests / n).is_file())
    assert "`QUICK`" in README
