"""eqrope.load's clear errors for damaged checkpoints: missing, truncated or flipped files,
a garbage header, foreign safetensors, a damaged config or one with fields of the wrong
type, config and arrays that do not belong together; and eqrope.save's refusals."""

import json

import equinox as eqx
import jax.numpy as jnp
import pytest
import safetensors.numpy

import eqrope
from _models import random_model


pytestmark = pytest.mark.usefixtures("precision")


def _model(seed=0, **kwargs):
    """A small model with every array random (norms and biases too)."""
    return random_model(seed, 17, 16, 2, 2, 32, **kwargs)


# -- missing and damaged files -----------------------------------------------------------


def test_missing_directory_and_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint directory"):
        eqrope.load(tmp_path / "nowhere")
    eqrope.save(tmp_path / "a", _model())
    with pytest.raises(FileNotFoundError, match="Pass the directory"):
        eqrope.load(tmp_path / "a" / "model.safetensors")
    (tmp_path / "a" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors is missing"):
        eqrope.load(tmp_path / "a")
    eqrope.save(tmp_path / "b", _model())
    (tmp_path / "b" / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        eqrope.load(tmp_path / "b")


@pytest.mark.parametrize("keep", [0.999, 0.5, 20, 4])
def test_truncated_arrays_file(tmp_path, keep):
    eqrope.save(tmp_path, _model())
    file = tmp_path / "model.safetensors"
    raw = file.read_bytes()
    n = int(len(raw) * keep) if isinstance(keep, float) else keep
    file.write_bytes(raw[:n])
    with pytest.raises(ValueError, match="truncated or corrupted"):
        eqrope.load(tmp_path)


def test_flipped_byte_in_array_data(tmp_path):
    eqrope.save(tmp_path, _model())
    file = tmp_path / "model.safetensors"
    raw = bytearray(file.read_bytes())
    raw[-3] ^= 0x40  # the last array's data; the header still parses
    file.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="does not match its checksum; the file is corrupted"):
        eqrope.load(tmp_path)


def test_garbage_header(tmp_path):
    eqrope.save(tmp_path, _model())
    file = tmp_path / "model.safetensors"
    raw = bytearray(file.read_bytes())
    raw[8:16] = b"\x00garbage"
    file.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="truncated or corrupted"):
        eqrope.load(tmp_path)


def test_foreign_safetensors_without_checksums(tmp_path):
    model = _model()
    eqrope.save(tmp_path, model)
    arrays = safetensors.numpy.load_file(str(tmp_path / "model.safetensors"))
    safetensors.numpy.save_file(arrays, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="no checksum for array"):
        eqrope.load(tmp_path)


def test_damaged_config(tmp_path):
    eqrope.save(tmp_path, _model())
    file = tmp_path / "config.json"
    text = file.read_text()
    file.write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        eqrope.load(tmp_path)
    data = json.loads(text)
    file.write_text(json.dumps({**data, "format_version": 99}))
    with pytest.raises(ValueError, match="format_version 99.*Upgrade eqrope"):
        eqrope.load(tmp_path)
    file.write_text(json.dumps({"model_type": "llama", "hidden_size": 16}))
    with pytest.raises(ValueError, match=r"use eqrope\.from_hf\("):
        eqrope.load(tmp_path)
    file.write_text(json.dumps({**data, "config": {**data["config"], "n_heads": 3}}))
    with pytest.raises(ValueError, match="'config' in .*config.json is invalid.*n_heads"):
        eqrope.load(tmp_path)
    file.write_text(json.dumps({**data, "config": {**data["config"], "colour": "red"}}))
    with pytest.raises(ValueError, match="colour"):
        eqrope.load(tmp_path)


# -- config and arrays that do not belong together --------------------------------------


def _edit_config(directory, **changes):
    file = directory / "config.json"
    data = json.loads(file.read_text())
    data["config"].update(changes)
    file.write_text(json.dumps(data))


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"d_ff": 24}, r"'blocks.mlp.w_gate_up' has shape \(2, 16, 128\), the config needs \(2, 16, 48\)"),
        ({"n_blocks": 3}, r"'blocks.attn.wqkv' has shape \(2, 16, 48\), the config needs \(3, 16, 48\)"),
        ({"dtype": "bfloat16"}, r"'embed' has dtype float32, the config needs bfloat16"),
        ({"tie_embeddings": True}, r"unexpected array 'head' \(shape \(16, 17\), dtype float32\)"),
        ({"head_bias": False}, r"unexpected array 'head_bias'"),
        ({"bias": True}, r"missing array 'blocks.attn.bqkv' \(shape \(2, 48\), dtype float32\)"),
    ],
)
def test_config_array_mismatch(tmp_path, changes, message):
    eqrope.save(tmp_path, _model())
    _edit_config(tmp_path, **changes)
    with pytest.raises(ValueError, match="do not belong together") as info:
        eqrope.load(tmp_path)
    assert info.match(message)


def test_missing_array(tmp_path):
    eqrope.save(tmp_path, _model(tie_embeddings=True))
    _edit_config(tmp_path, tie_embeddings=False)
    with pytest.raises(ValueError, match=r"missing array 'head' \(shape \(16, 17\)"):
        eqrope.load(tmp_path)


def test_save_refuses_bad_input(tmp_path):
    with pytest.raises(TypeError, match="RotaryDecoder"):
        eqrope.save(tmp_path, {"embed": jnp.zeros(3)})
    model = _model()
    reshaped = eqx.tree_at(lambda m: m.head, model, jnp.zeros((16, 18)))
    with pytest.raises(ValueError, match=r"'head' has shape \(16, 18\), the config needs \(16, 17\)"):
        eqrope.save(tmp_path / "x", reshaped)
    assert not (tmp_path / "x").exists()
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(FileExistsError, match="refusing to overwrite"):
        eqrope.save(tmp_path / "hf", model)
    assert (tmp_path / "hf" / "config.json").read_text() == '{"model_type": "llama"}'
    (tmp_path / "arrays").mkdir()
    (tmp_path / "arrays" / "model.safetensors").write_bytes(b"someone else's")
    with pytest.raises(FileExistsError, match="model.safetensors exists without an eqrope"):
        eqrope.save(tmp_path / "arrays", model)
    assert (tmp_path / "arrays" / "model.safetensors").read_bytes() == b"someone else's"
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        eqrope.save(tmp_path / "file", model)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"remat": "no"}, r"remat must be True or False, got 'no'"),
        ({"head_bias": "false"}, r"head_bias must be True or False, got 'false'"),
        ({"bias": 1}, r"bias must be True or False, got 1"),
        ({"rope_base": "1e4"}, r"rope_base must be a finite number, got '1e4'"),
        ({"norm_eps": None}, r"norm_eps must be a finite number, got None"),
        ({"rope_scaling": {"kind": "llama3", "factor": 4.0, "original_max_len": 0}},
         r"original_max_len must be a positive int, got 0"),
        ({"rope_scaling": {"kind": "llama3", "factor": 4.0, "original_max_len": -16}},
         r"original_max_len must be a positive int, got -16"),
        ({"rope_scaling": {"kind": "llama3", "factor": 4.0, "original_max_len": 16.0}},
         r"original_max_len must be a positive int, got 16.0"),
        ({"rope_scaling": {"kind": "linear", "factor": float("inf")}},
         r"factor must be a finite number, got inf"),
        ({"rope_scaling": {"kind": "linear", "factor": "2"}},
         r"factor must be a finite number, got '2'"),
        ({"rope_scaling": {"kind": "llama3", "factor": 4.0, "low_freq_factor": float("nan")}},
         r"low_freq_factor must be a finite number, got nan"),
        ({"rope_scaling": [4.0]}, r"rope_scaling must be a JSON object"),
    ],
)
def test_config_fields_of_the_wrong_type_are_refused(tmp_path, changes, message, unchecked):
    model = _model()
    data = {**model.config.to_dict(), **changes}
    with pytest.raises((TypeError, ValueError), match=message):
        eqrope.DecoderConfig.from_dict(data)
    eqrope.save(tmp_path, model)
    _edit_config(tmp_path, **changes)
    with pytest.raises(ValueError, match="'config' in .*config.json is invalid: .*" + message):
        eqrope.load(tmp_path)
