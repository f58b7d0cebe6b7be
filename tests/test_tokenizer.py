"""`eqrope.Tokenizer` and `eqrope.generate_text`.

A small byte-level BPE tokenizer is trained here with `tokenizers` (nothing is
downloaded). Two kinds of proof:

- against transformers (tests marked `hf`, skipped when it is not installed): the
  tokenizer saved with `PreTrainedTokenizerFast.save_pretrained` and read back by both
  `AutoTokenizer` and `eqrope.Tokenizer` encodes, decodes and renders chat templates alike;
- without transformers: the files read by hand-written directories, the errors, and
  `generate_text` against `eqrope.generate` plus `decode`.
"""

import json
import re
from datetime import datetime

import equinox as eqx
import jax
import jinja2
import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

import eqrope


PIECES = [
    "hello", " world", "The", " quick", " brown", " fox", "!", "?", ",", ".", " ", "  ", "\n",
    "\t", "é", "ö", "ß", "Ω", "ﬁ", "日本語", "中文", "🙂", "👍🏽", "👨‍👩‍👧", "123", " 4.5",
    "<s>", "</s>", "don't", "naïve", "Ünïcödé",
]  # fmt: skip
# A template that leans on what transformers' environment does: trim_blocks and
# lstrip_blocks, raise_exception, tojson (non-ASCII kept), loop controls, special tokens.
TEMPLATE = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role ' + message['role']) }}
    {% endif %}
    {% if message['role'] == 'system' and not loop.first %}{% continue %}{% endif %}
<|{{ message['role'] }}|>
{{ message['content'] | trim }}{{ eos_token }}
{% endfor %}
{% if tools %}<|tools|>{{ tools | tojson }}{% endif %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}"""
CHATS = [
    [{"role": "user", "content": "hello world"}],
    [
        {"role": "system", "content": "  Be brief. "},
        {"role": "user", "content": "naïve 🙂?"},
        {"role": "assistant", "content": "日本語!"},
        {"role": "user", "content": "again\n", "name": None},
    ],
]


def _strings(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return ["".join(rng.choice(PIECES, size=rng.integers(0, 12))) for _ in range(n)]


@pytest.fixture(scope="module")
def trained() -> tokenizers.Tokenizer:
    """A byte-level BPE tokenizer with `<s>`, `</s>`, `<pad>`, whose post-processor adds `<s>`."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_strings(300, seed=1), trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return tok


def _write(folder, trained, config=None, **files):
    """A checkpoint directory: tokenizer.json, tokenizer_config.json and other files."""
    folder.mkdir(exist_ok=True)
    trained.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"} if config is None else config
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    for name, text in files.items():
        (folder / name.replace("__", ".")).write_text(text)
    return folder


# -- against transformers -------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair(trained, tmp_path_factory):
    """(ours, theirs): the same saved tokenizer read by eqrope and by AutoTokenizer."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("hf_tokenizer")
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=trained, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = TEMPLATE
    fast.save_pretrained(folder)
    return eqrope.Tokenizer.from_pretrained(folder), transformers.AutoTokenizer.from_pretrained(folder)


@pytest.mark.hf
def test_encode_decode_match_transformers(pair):
    ours, theirs = pair
    texts = _strings(150)
    assert any(ord(c) > 0xFFFF for t in texts for c in t)  # emoji are in there
    for text in texts:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    assert ours.eos_ids == (theirs.eos_token_id,)
    assert ours.pad_id == theirs.pad_token_id
    assert ours.vocab_size == len(theirs)


@pytest.mark.hf
@pytest.mark.parametrize("add_generation_prompt", [False, True])
@pytest.mark.parametrize("chat", range(len(CHATS)))
def test_chat_template_matches_transformers(pair, chat, add_generation_prompt):
    ours, theirs = pair
    messages = CHATS[chat]
    kw = {"add_generation_prompt": add_generation_prompt}
    text = ours.apply_chat_template(messages, tokenize=False, **kw)
    assert text == theirs.apply_chat_template(messages, tokenize=False, **kw)
    assert ours.apply_chat_template(messages, **kw) == theirs.apply_chat_template(messages, **kw)["input_ids"]
    tools = [{"name": "météo", "parameters": {}}]
    text = ours.apply_chat_template(messages, tokenize=False, tools=tools, **kw)
    assert text == theirs.apply_chat_template(messages, tokenize=False, tools=tools, **kw)
    assert "météo" in text


@pytest.mark.hf
def test_template_exception_like_transformers(pair):
    ours, theirs = pair
    bad = [{"role": "robot", "content": "hi"}]
    for tokenizer in (ours, theirs):
        with pytest.raises(jinja2.TemplateError, match="unknown role robot"):
            tokenizer.apply_chat_template(bad, tokenize=False)


# -- without transformers -------------------------------------------------------------------


def test_from_pretrained_reads_the_files(trained, tmp_path):
    folder = _write(tmp_path / "a", trained, generation_config__json=json.dumps({"eos_token_id": [1, 2, 2]}))
    tok = eqrope.Tokenizer.from_pretrained(folder)
    assert tok.eos_ids == (1, 2)  # tokenizer_config's first, then the others once
    assert tok.pad_id == 2
    assert tok.encode("hello")[0] == trained.token_to_id("<s>")
    assert tok.decode(tok.encode("hello 🙂"), skip_special_tokens=True) == "hello 🙂"
    assert eqrope.Tokenizer.from_pretrained(folder / "tokenizer.json").eos_ids == (1, 2)
    # No chat template, no pad token, an AddedToken dict for eos_token.
    config = {"eos_token": {"content": "</s>", "__type": "AddedToken"}}
    tok = eqrope.Tokenizer.from_pretrained(_write(tmp_path / "b", trained, config))
    assert (tok.eos_ids, tok.pad_id, tok.chat_template) == ((1,), None, None)
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template(CHATS[0])


def test_chat_template_sources(trained, tmp_path):
    config = {"eos_token": "</s>", "chat_template": "inline {{ eos_token }}"}
    tok = eqrope.Tokenizer.from_pretrained(_write(tmp_path / "a", trained, config))
    assert tok.apply_chat_template(CHATS[0], tokenize=False) == "inline </s>"
    assert tok.apply_chat_template(CHATS[0]) == tok.encode("inline </s>", add_special_tokens=False)
    # chat_template.jinja wins over the inline template, as in transformers.
    folder = _write(tmp_path / "b", trained, config, chat_template__jinja="file {{ messages | length }}")
    assert eqrope.Tokenizer.from_pretrained(folder).apply_chat_template(CHATS[1], tokenize=False) == "file 4"
    # The older list of named templates.
    config["chat_template"] = [{"name": "tool_use", "template": "t"}, {"name": "default", "template": "d"}]
    tok = eqrope.Tokenizer.from_pretrained(_write(tmp_path / "c", trained, config))
    assert tok.apply_chat_template(CHATS[0], tokenize=False) == "d"
    # transformers' `{% generation %}` tag (assistant masks) renders its body; strftime_now.
    template = "{% generation %}{{ messages[0]['content'] }}{% endgeneration %} {{ strftime_now('%Y') }}"
    tok = eqrope.Tokenizer(tok.tokenizer, chat_template=template)
    assert tok.apply_chat_template(CHATS[0], tokenize=False) == f"hello world {datetime.now():%Y}"


def test_encode_batch(trained):
    tok = eqrope.Tokenizer(trained, eos_ids=(1,), pad_id=2)
    texts = ["hello world 🙂", "", "The quick brown fox!"]
    ids, lengths = tok.encode_batch(texts)
    rows = [tok.encode(t) for t in texts]
    assert ids.dtype == lengths.dtype == np.int32
    assert ids.shape == (3, max(map(len, rows)))
    assert lengths.tolist() == [len(r) for r in rows]
    for row, length, expected in zip(ids, lengths, rows):
        assert row[:length].tolist() == expected
        assert (row[length:] == 2).all()
    no_pad, _ = eqrope.Tokenizer(trained).encode_batch(texts)
    assert (no_pad[1, 1:] == 0).all()
    assert eqrope.Tokenizer(trained).encode_batch([])[0].shape == (0, 0)


def test_errors_name_the_file(trained, tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing / "tokenizer.json"))):
        eqrope.Tokenizer.from_pretrained(missing)
    folder = _write(tmp_path / "bad", trained)
    (folder / "tokenizer.json").write_text('{"model": 3}')
    with pytest.raises(ValueError, match=re.escape(f"{folder / 'tokenizer.json'} is not a valid")):
        eqrope.Tokenizer.from_pretrained(folder)
    folder = _write(tmp_path / "config", trained)
    (folder / "tokenizer_config.json").write_text("{oops")
    with pytest.raises(ValueError, match=re.escape(f"{folder / 'tokenizer_config.json'} is not valid JSON")):
        eqrope.Tokenizer.from_pretrained(folder)
    folder = _write(tmp_path / "eos", trained, {"eos_token": "<|eot|>"})
    with pytest.raises(ValueError, match=re.escape("eos_token '<|eot|>', which is not in the vocabulary")):
        eqrope.Tokenizer.from_pretrained(folder)
    with pytest.raises(TypeError, match="list of strings"):
        eqrope.Tokenizer(trained).encode_batch("hello")


# -- generate_text --------------------------------------------------------------------------

MAX_NEW = 8


@pytest.fixture(scope="module")
def model(trained):
    vocab = trained.get_vocab_size(with_added_tokens=True)
    return eqrope.RotaryDecoder(vocab, 16, 2, 1, 64, d_ff=32, key=jax.random.PRNGKey(0))


def _new_ids(tokens, start: int, eos_ids) -> list[int]:
    new = np.asarray(tokens)[start:].tolist()
    cut = [i for i, t in enumerate(new) if t in eos_ids]
    return new[: cut[0]] if cut else new


def test_generate_text_one_prompt(trained, model):
    tok = eqrope.Tokenizer(trained, eos_ids=(1,), pad_id=2)
    ids = np.asarray(tok.encode("hello world"), np.int32)
    for sampling in ({}, {"temperature": 1.0, "key": jax.random.PRNGKey(3)}):
        text = eqrope.generate_text(model, tok, "hello world", MAX_NEW, **sampling)
        tokens = eqrope.generate(model, ids, MAX_NEW, eos_id=1, **sampling)
        expected = tok.decode(_new_ids(tokens, len(ids), (1,)), skip_special_tokens=True)
        assert isinstance(text, str) and text == expected


def test_generate_text_batch(trained, model):
    tok = eqrope.Tokenizer(trained, eos_ids=(1,), pad_id=2)
    prompts = ["hello world", "🙂", "The quick brown fox jumps"]
    key = jax.random.PRNGKey(5)
    texts = eqrope.generate_text(model, tok, prompts, MAX_NEW, temperature=0.8, key=key)
    ids, lengths = tok.encode_batch(prompts)
    tokens = eqrope.generate(model, ids, MAX_NEW, prompt_lengths=lengths, eos_id=1, temperature=0.8, key=key)
    expected = [tok.decode(_new_ids(r, n, (1,)), skip_special_tokens=True) for r, n in zip(tokens, lengths)]
    assert isinstance(texts, list) and texts == expected
    assert eqrope.generate_text(model, tok, [], MAX_NEW) == []


def test_generate_text_stops_at_eos(trained, model):
    prompts = ["hello", "naïve 🙂 world"]
    # Greedy without EOS; the third new token of row 0 becomes an EOS id, so row 0 is cut there.
    free = eqrope.generate_text(model, eqrope.Tokenizer(trained), prompts, MAX_NEW)
    ids, lengths = eqrope.Tokenizer(trained).encode_batch(prompts)
    tokens = np.asarray(eqrope.generate(model, ids, MAX_NEW, prompt_lengths=lengths))
    stop = int(tokens[0, lengths[0] + 2])
    for eos_ids in ((stop,), (1, stop)):  # one EOS id: generate stops; several: cut on the host
        tok = eqrope.Tokenizer(trained, eos_ids=eos_ids)
        texts = eqrope.generate_text(model, tok, prompts, MAX_NEW)
        new = [_new_ids(r, n, eos_ids) for r, n in zip(tokens, lengths)]
        assert texts == [tok.decode(row, skip_special_tokens=True) for row in new]
        assert len(texts[0]) < len(free[0])
    # An EOS that wins at every step: nothing new.
    eos = trained.token_to_id("</s>")
    forced = eqx.tree_at(lambda m: m.head_bias, model, model.head_bias.at[eos].set(100.0))
    tok = eqrope.Tokenizer(trained, eos_ids=(eos,))
    assert eqrope.generate_text(forced, tok, prompts, MAX_NEW) == ["", ""]
    result = eqrope.generate(forced, ids, MAX_NEW, prompt_lengths=lengths, eos_id=eos, return_logprobs=True)
    assert np.asarray(result.lengths).tolist() == (lengths + 1).tolist()


def test_generate_text_reserved_arguments(trained, model):
    tok = eqrope.Tokenizer(trained, eos_ids=(1,))
    with pytest.raises(TypeError, match="eos_id"):
        eqrope.generate_text(model, tok, "hello", MAX_NEW, eos_id=1)
