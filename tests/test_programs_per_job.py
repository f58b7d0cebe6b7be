"""Issue 44, item 1: a short job compiles few programs, and each compile line says why.

The nine calls of the issue's newcomer script (generate, generate_text with the
tokenizer's EOS ids, an EOS list, streaming, `num_samples`, sampling settings, a stop
string, a ragged batch, a chat prompt), with compiles counted from eqrope's own log lines:
three programs at the cache length where the issue's script compiled four (streaming
keeps a program of its own), two at the other.
"""

import collections
import logging
import re

import jax
import numpy as np
import pytest
import tokenizers
from _models import random_model
from tokenizers import models, pre_tokenizers

import eqrope


WORDS = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "user", "assistant", "far", "away"]
TEMPLATE = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} </s> {% endfor %}assistant"


@pytest.fixture
def job(monkeypatch):
    # As in a fresh process: no generate program compiled before this test's.
    monkeypatch.setattr("eqrope.generation._compile_lines._SEEN", {})
    vocab = {w: i for i, w in enumerate(["<unk>", "</s>", "<s>", *WORDS])}
    raw = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.add_special_tokens(["</s>", "<s>"])
    tok = eqrope.Tokenizer(raw, eos_ids=(1, 2), chat_template=TEMPLATE)
    # Sizes no other test uses, so that every program compiles here.
    return random_model(7, len(vocab) + 3, 16, 2, 1, 48), tok


def _compiles(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("compiling generate")]


def test_nine_calls_compile_few_programs_per_cache_length(job, caplog):
    model, tok = job
    caplog.set_level(logging.INFO, logger="eqrope")
    ids = np.asarray(tok.encode("the cat sat"), np.int32)
    key = jax.random.key(0)
    pieces = []
    eqrope.generate(model, ids, 8)
    eqrope.generate_text(model, tok, "the cat sat", 8)  # two EOS ids
    eqrope.generate(model, ids, 8, eos_id=[4])
    eqrope.generate_text(model, tok, "the cat sat", 8, stream=lambda row, piece: pieces.append(piece))
    eqrope.generate_text(model, tok, "the cat sat", 8, num_samples=3, temperature=1.0, key=key)
    eqrope.generate(model, ids, 8, temperature=0.7, top_p=0.9, repetition_penalty=1.2, key=key)
    eqrope.generate_text(model, tok, "the cat sat", 8, stop=["t s"])
    long = "the cat sat on a mat the dog ran far away the cat sat on a mat the dog"
    eqrope.generate_text(model, tok, [long, "a dog"], 8)
    chat = tok.apply_chat_template([{"role": "user", "content": long}], tokenize=False)
    eqrope.generate_text(model, tok, chat, 8)
    lines = _compiles(caplog)
    per_length = collections.Counter(re.search(r"cache length (\d+)", line)[1] for line in lines)
    # Cache length 16: the plain program (generate with or without EOS ids, sampling
    # settings), num_samples=3, streaming, which must hold a host callback (see
    # generation/_stream.py), and stop strings: a call without any runs a program that
    # matches nothing. Cache length 32: a batch of 2 and a single prompt.
    assert per_length == {"16": 4, "32": 2}, lines
    # Each line after the first says what made it a new program.
    assert "(a new batch, cache length, num_samples or static setting compiles once" in lines[0]
    assert all("; new: " in line for line in lines[1:]), lines
    assert "the on_token callback False -> True" in lines[1], lines
    assert "num_samples None -> 3" in lines[2], lines
    assert "the size bucket of stop strings" in lines[3], lines


def test_each_static_setting_is_named(job, caplog):
    _, tok = job
    model = random_model(8, tok.vocab_size + 4, 16, 2, 1, 48)  # not the other test's programs
    ids = np.arange(3, 8, dtype=np.int32)
    eqrope.generate(model, ids, 3)
    caplog.set_level(logging.INFO, logger="eqrope")
    calls = {
        "prefill_chunk 16 -> 5": dict(prefill_chunk=5),
        "check_finite True -> False": dict(check_finite=False),
        "the PRNG implementation key<fry> -> key<rbg>": dict(temperature=1.0, key=jax.random.key(0, impl="rbg")),
        "the size bucket of eos_id 8 -> 16": dict(eos_id=list(range(9))),
    }
    for expected, kwargs in calls.items():
        caplog.clear()
        eqrope.generate(model, ids, 3, **kwargs)
        assert any(expected in line for line in _compiles(caplog)), (expected, _compiles(caplog))
    caplog.clear()
    eqrope.generate(model, np.stack([ids, ids]), 3, temperature=[0.0, 0.5], key=jax.random.key(1))
    assert "settings per row False -> True" in _compiles(caplog)[0], _compiles(caplog)
    assert "size bucket" not in _compiles(caplog)[0]  # the rows axis is not a new bucket
    caplog.clear()
    eqrope.generate(model.unstacked(), ids, 3)
    assert "the model's layout (stacked or per-block weights, or another architecture): changed" in _compiles(caplog)[0]
    caplog.clear()
    eqrope.generate(model, ids, 3, on_token=lambda *a: None)
    assert "the on_token callback False -> True" in _compiles(caplog)[0]
    caplog.clear()
    eqrope.generate(model, ids, 3, on_token=lambda row, pos, token: None)  # another: nothing new
    assert _compiles(caplog) == []
