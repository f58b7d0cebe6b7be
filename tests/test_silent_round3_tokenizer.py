"""Nothing silent, round 3 (issue 27): tokenizer_config.json, generation_config.json and
chat templates.

Every field read from tokenizer_config.json and generation_config.json is checked for
type and range and named by its key in that file; `apply_chat_template` takes a batch and
refuses other shapes; generation_config.json fields that change nothing load, those that
would change the tokens are refused. Each test names the item of the issue it pins.
Tokenizers are trained with `tokenizers` (as in test_tokenizer.py); nothing is downloaded.
"""

import json
import re

import pytest

import eqrope
from test_tokenizer import CHATS, TEMPLATE, _write, trained  # noqa: F401 (trained is a fixture)


# -- items 8, 10 and the class: tokenizer_config.json ----------------------------------------


@pytest.mark.parametrize(
    "template, shown",
    [
        ([{"template": "t"}], "chat_template[0]"),
        ([{"name": "default", "template": "d"}, {"name": 3, "template": "t"}], "chat_template[1]"),
        ([{"name": "default"}], "chat_template[0]"),
        (3, "chat_template=3"),
        ({"default": "d"}, "chat_template={'default': 'd'}"),
    ],
)
def test_chat_template_entries_are_checked(trained, tmp_path, template, shown):
    """Item 8: a list entry without "name" raised a bare KeyError: 'name'."""
    folder = _write(tmp_path, trained, {"eos_token": "</s>", "chat_template": template})
    with pytest.raises(ValueError) as info:
        eqrope.Tokenizer.from_pretrained(folder)
    message = str(info.value)
    assert str(folder / "tokenizer_config.json") in message and shown in message


@pytest.mark.parametrize("name", ["eos_token", "pad_token", "bos_token", "unk_token", "mask_token"])
@pytest.mark.parametrize("value", [1, True, ["</s>"], {"lstrip": False}, {"content": 1}])
def test_special_tokens_must_be_strings_or_added_tokens(trained, tmp_path, name, value):
    """Item 10: `"eos_token": 1` became the token "1" (a digit became the EOS)."""
    folder = _write(tmp_path, trained, {name: value})
    with pytest.raises(ValueError) as info:
        eqrope.Tokenizer.from_pretrained(folder)
    message = str(info.value)
    assert f"{name}={value!r}" in message and str(folder / "tokenizer_config.json") in message
    assert "AddedToken" in message


def test_special_tokens_as_strings_and_records_still_load(trained, tmp_path):
    config = {"eos_token": {"content": "</s>", "lstrip": False, "__type": "AddedToken"}, "pad_token": "<pad>"}
    tok = eqrope.Tokenizer.from_pretrained(_write(tmp_path, trained, config))
    assert tok.eos_ids == (trained.token_to_id("</s>"),) and tok.pad_id == trained.token_to_id("<pad>")
    assert tok.special_tokens == {"eos_token": "</s>", "pad_token": "<pad>"}


def test_clean_up_flag_must_be_a_bool(trained, tmp_path):
    """The class of item 10: `"clean_up_tokenization_spaces": "false"` read as true."""
    folder = _write(tmp_path, trained, {"clean_up_tokenization_spaces": "false"})
    with pytest.raises(ValueError, match="clean_up_tokenization_spaces") as info:
        eqrope.Tokenizer.from_pretrained(folder)
    assert str(folder / "tokenizer_config.json") in str(info.value)


# -- item 9: eos_token_id in generation_config.json ------------------------------------------


@pytest.mark.parametrize(
    "value, key", [("</s>", "eos_token_id"), ([1, "2"], "eos_token_id[1]"), (True, "eos_token_id"),
                   (1.0, "eos_token_id"), (-1, "eos_token_id")],  # fmt: skip
)
def test_tokenizer_reads_eos_token_id_checked(trained, tmp_path, value, key):
    """Item 9: a string `eos_token_id` was read character by character (int('<'))."""
    folder = _write(tmp_path, trained, generation_config__json=json.dumps({"eos_token_id": value}))
    with pytest.raises(ValueError) as info:
        eqrope.Tokenizer.from_pretrained(folder)
    message = str(info.value)
    assert str(folder / "generation_config.json") in message and f"{key} must be" in message


def test_tokenizer_reads_an_empty_eos_list_as_none(trained, tmp_path):
    folder = _write(tmp_path, trained, generation_config__json=json.dumps({"eos_token_id": []}))
    assert eqrope.Tokenizer.from_pretrained(folder).eos_ids == (trained.token_to_id("</s>"),)


def _generation_config(tmp_path, fields: dict):
    (tmp_path / "generation_config.json").write_text(json.dumps(fields))
    return eqrope.GenerationConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "fields, key",
    [
        ({"eos_token_id": "</s>"}, "eos_token_id"),
        ({"eos_token_id": [2, "</s>"]}, "eos_token_id[1]"),
        ({"pad_token_id": "0"}, "pad_token_id"),
        ({"do_sample": "false"}, "do_sample"),
        ({"do_sample": 1}, "do_sample"),
        ({"temperature": "0.7"}, "temperature"),
        ({"top_k": True}, "top_k"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": True}, "top_p"),
        ({"max_new_tokens": 8.5}, "max_new_tokens"),
        ({"min_new_tokens": False}, "min_new_tokens"),
        ({"num_return_sequences": True}, "num_return_sequences"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"stop_strings": [[1, 2]]}, "stop_strings"),
        ({"stop_strings": [""]}, "stop_strings[0]"),
        ({"bad_words_ids": [["a"]]}, "bad_words_ids"),
    ],
)
def test_generation_config_fields_are_named_by_their_keys(tmp_path, fields, key):
    """Item 9 and its class: `eos_token_id: "</s>"` was reported as `eos_id` (a
    TypeError); `do_sample: "false"` sampled, `top_k: true` read as off."""
    with pytest.raises(ValueError) as info:
        _generation_config(tmp_path, fields)
    message = str(info.value)
    assert message.startswith(f"GenerationConfig.from_pretrained: {tmp_path / 'generation_config.json'}")
    assert key in message
    # Not under GenerationConfig's own names for them.
    eqrope_names = r"\b(eos_id|pad_id|min_new|max_new|bad_ids|num_samples|stop)(\[\d+\])? (must|is)\b"
    assert not re.search(eqrope_names, message), message


# -- item 11: apply_chat_template's messages -------------------------------------------------


def test_apply_chat_template_takes_a_batch(trained, tmp_path):
    """Item 11: a batch of conversations raised AttributeError; it renders one string (or
    one list of ids) per conversation, each as the conversation alone renders."""
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATE}
    tok = eqrope.Tokenizer.from_pretrained(_write(tmp_path, trained, config))
    for kw in ({}, {"add_generation_prompt": True}):
        texts = tok.apply_chat_template(CHATS, tokenize=False, **kw)
        assert texts == [tok.apply_chat_template(c, tokenize=False, **kw) for c in CHATS]
        assert len(set(texts)) == 2
        ids = tok.apply_chat_template(tuple(CHATS), **kw)
        assert ids == [tok.encode(t, add_special_tokens=False) for t in texts]


@pytest.mark.hf
def test_apply_chat_template_batch_matches_transformers(trained, tmp_path):
    transformers = pytest.importorskip("transformers")
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=trained, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = TEMPLATE
    fast.save_pretrained(tmp_path)
    ours = eqrope.Tokenizer.from_pretrained(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for kw in ({}, {"add_generation_prompt": True}):
        assert ours.apply_chat_template(CHATS, tokenize=False, **kw) == theirs.apply_chat_template(
            CHATS, tokenize=False, **kw
        )


@pytest.mark.parametrize(
    "messages, error, shown",
    [
        ({"role": "user", "content": "hi"}, TypeError, "got a dict (wrap one message in a list"),
        ("hello", TypeError, "got a str"),
        (None, TypeError, "got a NoneType"),
        (["hello"], TypeError, "messages[0] is a str ('hello'), not a message"),
        ([{"role": "user", "content": "hi"}, 3], TypeError, "messages[1] is a int (3)"),
        ([[{"role": "user", "content": "hi"}], "hello"], TypeError, "messages[1] is a str"),
        ([[{"role": "user", "content": "hi"}], ["x"]], TypeError, "messages[1][0] is a str"),
        ([[{"role": "user", "content": "hi"}], []], ValueError, "messages[1] is empty"),
        ([], ValueError, "messages is empty"),
    ],
)
def test_apply_chat_template_refuses_other_shapes(trained, messages, error, shown):
    """Item 11: a message that is not a dict, or a single dict, raised a bare
    AttributeError; now the error shows the expected shape."""
    tok = eqrope.Tokenizer(trained, chat_template="{{ messages | length }}")
    with pytest.raises(error) as info:
        tok.apply_chat_template(messages, tokenize=False)
    message = str(info.value)
    assert message.startswith("apply_chat_template: ") and shown in message
    if error is TypeError:
        assert 'a list of {"role": ..., "content": ...} dicts' in message


# -- item 13: generation_config.json fields that change nothing ----------------------------

_HARMLESS = {
    "suppress_tokens": [], "begin_suppress_tokens": [], "num_assistant_tokens": 20,
    "num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.4,
    "is_assistant": False, "output_past_key_values": False, "assistant_lookbehind": 10,
    "num_beams": None, "length_penalty": 1, "token_healing": False, "max_time": None,
    "sequence_bias": None, "bad_words_ids": [], "stop_strings": [], "eos_token_id": [],
    "top_k": None, "prompt_lookup_num_tokens": None,
}  # fmt: skip


def test_harmless_generation_fields_load(tmp_path):
    """Item 13: these were refused; at these values they change nothing, so the config is
    the one of a file without them."""
    assert _generation_config(tmp_path, _HARMLESS) == _generation_config(tmp_path, {})
    # Without max_new_tokens or max_length, transformers generates 20 new tokens (issue 44).
    assert _generation_config(tmp_path, {}) == eqrope.GenerationConfig(top_k=50, max_new=20)


@pytest.mark.parametrize(
    "fields, shown",
    [
        ({"num_assistant_tokens": 8}, "num_assistant_tokens=8 (pass draft_len=... to generate"),
        ({"suppress_tokens": [5]}, "suppress_tokens=[5] (use bad_ids)"),
        ({"num_assistant_tokens_schedule": "heuristic"}, "num_assistant_tokens_schedule='heuristic'"),
        ({"is_assistant": True}, "is_assistant=True"),
        ({"num_beams": True}, "num_beams=True"),  # a bool is not the count 1
        ({"prompt_lookup_num_tokens": 10}, "prompt_lookup_num_tokens=10 (pass draft='prompt_lookup'"),
    ],
)
def test_generation_fields_that_would_change_the_tokens_are_refused(tmp_path, fields, shown):
    """Item 13: a field eqrope does not implement is still refused, by name, at a value
    that changes the tokens; `num_assistant_tokens` points to `draft_len`."""
    with pytest.raises(ValueError) as info:
        _generation_config(tmp_path, fields)
    assert shown in str(info.value)


@pytest.mark.hf
def test_harmless_fields_written_by_transformers_load(tmp_path):
    transformers = pytest.importorskip("transformers")
    transformers.GenerationConfig(
        do_sample=True, temperature=0.7, suppress_tokens=[], num_assistant_tokens=20,
        num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.4,
        is_assistant=False, eos_token_id=2,
    ).save_pretrained(tmp_path)  # fmt: skip
    written = json.loads((tmp_path / "generation_config.json").read_text())
    assert written["suppress_tokens"] == [] and written["num_assistant_tokens"] == 20
    config = eqrope.GenerationConfig.from_pretrained(tmp_path)
    assert config == eqrope.GenerationConfig(temperature=0.7, top_k=50, eos_id=2, max_new=20)


