"""Nothing silent, round 3 (issue 27): the defects that concern files on disk.

Every field read from a JSON file (config.json, tokenizer_config.json,
generation_config.json) is checked for type and range and named by its key in that file;
a key the file leaves out means what transformers' config class makes of it; and a save
into a directory this user cannot write raises before anything is written.

Each test names the item of the issue it pins. Checkpoints are written by hand (as in
test_hf.py) or by transformers' own classes (tests marked `hf`); tokenizers are trained
with `tokenizers` (as in test_tokenizer.py). Nothing is downloaded.
"""

import json
import os
import pwd
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import pytest

import eqrope
from eqrope.weights._hf_config import ARCHITECTURES, decoder_config
from _hf_llama import BASE, random_hf_tensors, write_hf_dir
from test_tokenizer import CHATS, TEMPLATE, _write, trained  # noqa: F401 (trained is a fixture)


# eqrope's own names for config.json fields; an error about a config.json must use the
# file's keys instead (`rms_norm_eps`, not `norm_eps`).
_EQROPE_NAMES = re.compile(
    r"(?<![\w.])(norm_eps|rope_base|n_kv_heads|n_heads|d_model|original_max_len)\b|RopeScaling"
)


def _from_hf_error(tmp_path, hf: dict, tensors=None, **kwargs) -> str:
    """The message of the ValueError `from_hf` raises for a Llama-based `hf` config."""
    write_hf_dir(tmp_path, hf, random_hf_tensors(BASE) if tensors is None else tensors)
    with pytest.raises(ValueError) as info:
        eqrope.from_hf(tmp_path, **kwargs)
    return str(info.value)


# -- item 4: a key config.json leaves out means transformers' default -------------------------


def test_mistral_without_sliding_window_has_transformers_window(tmp_path):
    """Item 4: MistralConfig's `sliding_window` defaults to 4096; it loaded with none."""
    hf = {**BASE, "model_type": "mistral", "num_key_value_heads": 2}
    tensors = random_hf_tensors(hf)
    model = eqrope.from_hf(write_hf_dir(tmp_path / "absent", hf, tensors))
    assert model.config.attention.window == 4096
    assert model.config.attention.window_blocks is None  # every block, as Mistral
    # An explicit null is no window, as in transformers.
    model = eqrope.from_hf(write_hf_dir(tmp_path / "null", {**hf, "sliding_window": None}, tensors))
    assert model.config.attention.window is None


def test_other_absent_keys_take_the_family_defaults():
    """Item 4, the class: Mistral's 8 key/value heads, Qwen3's 128-wide heads, Qwen2's
    4096 window when `use_sliding_window` is set without a `sliding_window`."""
    sizes = dict(hidden_size=256, num_attention_heads=16, num_hidden_layers=3,
                 intermediate_size=64, vocab_size=50, max_position_embeddings=64)  # fmt: skip
    mistral = decoder_config({"model_type": "mistral", **sizes}, "config.json", "float32", None)
    assert mistral.n_kv_heads == 8
    qwen3 = decoder_config({"model_type": "qwen3", **sizes, "num_key_value_heads": 4}, "c", "float32", None)
    assert qwen3.head_dim == 128
    qwen2 = {"model_type": "qwen2", **sizes, "num_key_value_heads": 4, "use_sliding_window": True,
             "max_window_layers": 1}  # fmt: skip
    qwen2 = decoder_config(qwen2, "c", "float32", None)
    assert qwen2.attention.window == 4096 and qwen2.attention.window_blocks == (1, 2)


@pytest.mark.hf
@pytest.mark.parametrize("window", [False, True])
@pytest.mark.parametrize("family", sorted(ARCHITECTURES))
def test_absent_keys_read_as_transformers_config_classes_read_them(family, window):
    """Item 4, against transformers: a config.json with only `model_type` (and, for Qwen,
    `use_sliding_window`) gives the sizes, heads, window, eps and base that the family's
    transformers config class fills in."""
    transformers = pytest.importorskip("transformers")
    hf = {"model_type": family}
    if window and family.startswith("qwen"):
        hf["use_sliding_window"] = True
    classes = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config",
               "qwen3": "Qwen3Config"}  # fmt: skip
    theirs = getattr(transformers, classes[family]).from_dict(dict(hf))
    ours = decoder_config(hf, "config.json", "float32", None)
    n_blocks = theirs.num_hidden_layers
    assert (ours.vocab_size, ours.d_model, ours.n_heads, ours.n_blocks, ours.d_ff, ours.max_len) == (
        theirs.vocab_size, theirs.hidden_size, theirs.num_attention_heads, n_blocks,
        theirs.intermediate_size, theirs.max_position_embeddings,
    )  # fmt: skip
    assert ours.n_kv_heads == theirs.num_key_value_heads
    head_dim = getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads
    assert ours.head_dim == head_dim
    assert ours.norm_eps == theirs.rms_norm_eps
    assert ours.rope_base == theirs.rope_parameters["rope_theta"]
    assert ours.tie_embeddings == theirs.tie_word_embeddings
    if family == "llama":
        windowed = [False] * n_blocks
    elif family == "mistral":
        windowed = [theirs.sliding_window is not None] * n_blocks
    else:
        windowed = [kind == "sliding_attention" for kind in theirs.layer_types]
    assert list(ours.attention.windowed(n_blocks)) == windowed
    if any(windowed):
        assert ours.attention.window == theirs.sliding_window
    if family != "llama" and window:
        assert any(windowed)  # the case this test is about: a window nobody wrote


# -- items 5 and 6: the dtype ---------------------------------------------------------------


def test_integer_embedding_is_named_as_a_tensor(tmp_path):
    """Item 5: integer weights in embed_tokens were blamed on config.json's `dtype`."""
    tensors = random_hf_tensors(BASE)
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].astype(np.int32)
    message = _from_hf_error(tmp_path, BASE, tensors)
    assert "tensor 'model.embed_tokens.weight' has dtype int32, not a floating dtype" in message
    assert "does not give a valid eqrope config" not in message and "config.json implies" not in message


def test_float64_embedding_without_x64_is_named_as_a_tensor(tmp_path):
    """Item 5, the class: a float64 checkpoint kept as float64 needs x64; say which tensor
    and how to convert, not that config.json is invalid."""
    tensors = {k: v.astype(np.float64) for k, v in random_hf_tensors(BASE).items()}
    message = _from_hf_error(tmp_path, BASE, tensors)
    assert "'model.embed_tokens.weight'" in message and "float64" in message
    assert "jax_enable_x64" in message and "dtype='float32'" in message
    assert "does not give a valid eqrope config" not in message
    assert eqrope.from_hf(tmp_path, dtype="float32").embed.dtype == np.float32


@pytest.mark.parametrize("dtype", ["bogus", "int8", np.int32, 3])
def test_from_hf_refuses_a_dtype_models_cannot_hold(tmp_path, dtype):
    """Item 6: `dtype="bogus"` raised NumPy's bare TypeError; `"int8"` was blamed on
    config.json."""
    message = _from_hf_error(tmp_path, BASE, dtype=dtype)
    assert message.startswith(f"from_hf: dtype={dtype!r}")
    assert "float32, bfloat16, float16, float64" in message
    assert "config.json" not in message


# -- item 7: invalid values named by their config.json keys -----------------------------------

_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 64}  # fmt: skip
_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize(
    "change, key",
    [
        ({"rms_norm_eps": -1e-6}, "rms_norm_eps"),
        ({"rms_norm_eps": 0.0}, "rms_norm_eps"),
        ({"rope_theta": -10000.0}, "rope_theta"),
        ({"rope_theta": 1.0}, "rope_theta"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 0.5}}, "rope_parameters.rope_theta"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"head_dim": 15}, "head_dim"),
        ({"hidden_size": 60}, "num_attention_heads"),  # 60 / 4 = 15, an odd head width
        ({"rope_scaling": {"rope_type": "linear", "factor": -2.0}}, "rope_scaling.factor"),
        ({"rope_scaling": {**_LLAMA3, "low_freq_factor": 4.0, "high_freq_factor": 1.0}},
         "rope_scaling.high_freq_factor"),
        ({"rope_scaling": {**_YARN, "beta_fast": 1.0, "beta_slow": 32.0}}, "rope_scaling.beta_fast"),
        ({"rope_scaling": {**_YARN, "attention_factor": -1.0}}, "rope_scaling.attention_factor"),
        ({"rope_scaling": {**_LLAMA3, "original_max_position_embeddings": 0}},
         "rope_scaling.original_max_position_embeddings"),
    ],
)
def test_invalid_config_values_are_named_by_their_config_keys(tmp_path, change, key):
    """Item 7: a negative `rms_norm_eps` was reported as `norm_eps`, a negative
    `rope_theta` as `rope_base`, and so on."""
    message = _from_hf_error(tmp_path, {**BASE, **change})
    assert key in message and str(tmp_path / "config.json") in message
    assert not _EQROPE_NAMES.search(message), message


@pytest.mark.parametrize(
    "change, key",
    [
        ({"model_type": ["llama"]}, "model_type"),
        ({"model_type": "qwen2", "layer_types": [{"kind": "full"}, "full_attention"]}, "layer_types"),
        ({"rope_parameters": {"rope_type": ["linear"], "factor": 2.0}}, "rope_parameters type"),
        ({"rope_parameters": False}, "rope_parameters"),
    ],
)
def test_config_values_of_any_json_type_are_named(tmp_path, change, key):
    """Item 7, the class: a list where a string belongs raised a bare TypeError
    (unhashable), `rope_parameters: false` was read as no scaling."""
    message = _from_hf_error(tmp_path, {**BASE, "num_key_value_heads": 2, **change})
    assert key in message and str(tmp_path / "config.json") in message


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


# -- also: a save into a directory this user cannot write --------------------------------------

_CHILD = textwrap.dedent(
    """
    import hashlib, json, os, shutil, sys, tempfile
    from pathlib import Path
    import jax
    import eqrope

    base, uid, gid = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])

    def model(seed):
        return eqrope.RotaryDecoder(11, 8, 2, 1, 16, head_bias=False, key=jax.random.PRNGKey(seed))

    # Everything a save and a load import or compile, first, while this process may still
    # read the interpreter's folders; then drop to the other user (a no-op if already it).
    warm = Path(tempfile.mkdtemp())
    for seed in (0, 1):
        eqrope.load(eqrope.save(warm / "ckpt", model(seed)))
        eqrope.to_hf(model(seed), warm / "hf")
    shutil.rmtree(warm)
    if os.getuid() != uid:
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
        except OSError as e:  # say a container that maps no other user
            print(f"CANNOT_DROP {e}")
            sys.exit(0)

    def snapshot(folder):
        return {
            str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(folder.rglob("*"))
        }

    def attempt(save):
        try:
            save()
        except Exception as e:
            return [type(e).__name__, str(e)]
        return None

    out = {"uid": os.getuid()}
    box = base / "box"
    box.mkdir()
    ckpt = box / "ckpt"
    eqrope.save(ckpt, model(0))
    before = snapshot(base)
    os.chmod(ckpt, 0o555)  # the checkpoint directory itself read-only
    out["dir"] = attempt(lambda: eqrope.save(ckpt, model(1)))
    os.chmod(ckpt, 0o755)
    out["dir_kept"] = snapshot(base) == before
    os.chmod(box, 0o555)  # the folder that holds it read-only
    out["parent"] = attempt(lambda: eqrope.save(ckpt, model(1)))
    out["new"] = attempt(lambda: eqrope.save(box / "fresh" / "ckpt", model(1)))
    os.chmod(box, 0o755)
    out["parent_kept"] = snapshot(base) == before
    out["loads_old"] = bool((eqrope.load(ckpt).embed == model(0).embed).all())

    hf = base / "hf"
    eqrope.to_hf(model(0), hf)
    hf_before = snapshot(hf)
    os.chmod(hf, 0o555)
    out["to_hf_dir"] = attempt(lambda: eqrope.to_hf(model(1), hf))
    os.chmod(hf, 0o755)
    os.chmod(hf / "model.safetensors", 0o444)
    out["to_hf_file"] = attempt(lambda: eqrope.to_hf(model(1), hf))
    os.chmod(hf / "model.safetensors", 0o644)
    out["to_hf_kept"] = snapshot(hf) == hf_before

    eqrope.save(ckpt, model(1))  # where this user can write, a save still replaces
    out["saves_new"] = bool((eqrope.load(ckpt).embed == model(1).embed).all())
    print("RESULT " + json.dumps(out))
    """
)


def _run_as_another_user(script: str) -> tuple[dict, Path]:
    """Run `script` in a fresh Python that drops to a user who is not root (`os.setuid`
    in the child, to `nobody`; or no drop when this user is not root), in a folder that
    user owns; return the JSON it prints and that folder (removed by then)."""
    uid, gid = os.geteuid(), os.getegid()
    if uid == 0:
        try:
            nobody = pwd.getpwnam("nobody")
        except KeyError:
            pytest.skip("running as root and there is no 'nobody' user to drop to")
        uid, gid = nobody.pw_uid, nobody.pw_gid
    base = Path(tempfile.mkdtemp(prefix="eqrope-permissions-"))
    try:
        os.chown(base, uid, gid)
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "JAX_PLATFORMS": "cpu"}
        done = subprocess.run(
            [sys.executable, "-c", script, str(base), str(uid), str(gid)],
            env=env, cwd=base, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        if "CANNOT_DROP" in done.stdout:
            pytest.skip(f"cannot setuid to uid {uid} here: {done.stdout.strip()}")
        line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")][-1]
        return json.loads(line.removeprefix("RESULT ")), base.resolve()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_save_where_the_user_cannot_write(tmp_path):
    """Also: as a non-root user (root writes anywhere, so the probe could not run), a save
    into a directory the user cannot write raises a PermissionError naming the function
    and the directory, and the old checkpoint is left intact, with nothing beside it."""
    out, base = _run_as_another_user(_CHILD)
    assert out["uid"] != 0
    for case, who, where in [
        ("dir", "eqrope.save", "box/ckpt"),
        ("parent", "eqrope.save", "box"),
        ("new", "eqrope.save", "box"),
        ("to_hf_dir", "to_hf", "hf"),
        ("to_hf_file", "to_hf", "hf/model.safetensors"),
    ]:
        assert out[case] is not None, f"{case}: the save did not raise"
        kind, message = out[case]
        assert kind == "PermissionError", (case, kind, message)
        assert message.startswith(f"{who}: cannot write to "), message
        assert f"may not write {base / where} (" in message, message
        assert "Nothing was written" in message
    assert out["dir_kept"] and out["parent_kept"] and out["to_hf_kept"]
    assert out["loads_old"] and out["saves_new"]
