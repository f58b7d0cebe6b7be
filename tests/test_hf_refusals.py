"""Refusals of Hugging Face checkpoints: config fields eqrope does not implement, weights
that do not match their config, missing, damaged or escaping files, numbers of the wrong
type or range; and the layouts it reads (shards in subdirectories, the hub cache's links).
"""

import json
import jax
import numpy as np
import pytest

import eqrope
from _hf_llama import BASE, random_hf_tensors, write_hf_dir


@pytest.mark.parametrize(
    "change, message",
    [
        ({"attention_bias": True}, r"missing tensor 'model.layers.0.self_attn.q_proj.bias'"),
        ({"mlp_bias": True}, "mlp_bias=True.*only beside attention biases"),
        ({"model_type": "mistral", "attention_bias": True}, "attention_bias=True.*mistral"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"head_dim": 32}, r"q_proj.weight' has shape \(64, 64\), config.json implies \(128, 64\)"),
        ({"model_type": "gpt2"}, "model_type='gpt2'.*'llama', 'mistral', 'qwen2', 'qwen3'"),
        ({"model_type": "qwen2", "layer_types": ["full_attention"]}, "layer_types=.*2 entries"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta": 1}}, r"keys \['beta'\].*type 'yarn'"),
        ({"rope_scaling": {"type": "dynamic", "factor": 4.0, "mscale": 1.0}}, r"keys \['mscale'\]"),
        ({"rope_parameters": {"rope_type": "longrope", "factor": 4.0}}, "rope_parameters type 'longrope'"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "beta": 1}}, r"keys \['beta'\]"),
        ({"rope_scaling": {"rope_type": "linear"}}, "without a 'factor'"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"vocab_size": None}, "no field 'vocab_size'"),
    ],
)
def test_unsupported_config_fields_are_refused(tmp_path, change, message):
    hf = {**BASE, **change}
    write_hf_dir(tmp_path, hf, random_hf_tensors(BASE))
    with pytest.raises(ValueError, match=message):
        eqrope.from_hf_llama(tmp_path)


def test_weights_that_do_not_match_the_config(tmp_path):
    tensors = random_hf_tensors(BASE)
    broken = dict(tensors)
    del broken["model.layers.1.mlp.up_proj.weight"]
    broken["model.layers.0.self_attn.k_proj.weight"] = np.zeros((8, 64), np.float32)
    broken["model.layers.0.self_attn.q_proj.bias"] = np.zeros((64,), np.float32)
    broken["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.zeros((8,), np.float32)  # ignored
    write_hf_dir(tmp_path, BASE, broken)
    with pytest.raises(ValueError, match="do not match its config.json") as info:
        eqrope.from_hf_llama(tmp_path)
    assert info.match("missing tensor 'model.layers.1.mlp.up_proj.weight'")
    assert info.match("unexpected tensor 'model.layers.0.self_attn.q_proj.bias'")
    assert info.match(
        r"'model.layers.0.self_attn.k_proj.weight' has shape \(8, 64\), "
        r"config.json implies \(64, 64\)"
    )
    assert "inv_freq" not in str(info.value)


def test_tied_checkpoint_with_a_different_head(tmp_path):
    hf = {**BASE, "tie_word_embeddings": True}
    tensors = random_hf_tensors(hf)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] + 1
    write_hf_dir(tmp_path, hf, tensors)
    with pytest.raises(ValueError, match="tie_word_embeddings=true but lm_head.weight differs"):
        eqrope.from_hf_llama(tmp_path)


def test_missing_and_damaged_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="no directory"):
        eqrope.from_hf_llama(tmp_path / "nowhere")
    write_hf_dir(tmp_path / "a", BASE, random_hf_tensors(BASE))
    (tmp_path / "a" / "model.safetensors").rename(tmp_path / "a" / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="safe_serialization=True"):
        eqrope.from_hf_llama(tmp_path / "a")
    write_hf_dir(tmp_path / "b", BASE, random_hf_tensors(BASE), shards=2)
    (tmp_path / "b" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors listed in"):
        eqrope.from_hf_llama(tmp_path / "b")
    write_hf_dir(tmp_path / "c", BASE, random_hf_tensors(BASE))
    file = tmp_path / "c" / "model.safetensors"
    file.write_bytes(file.read_bytes()[:1000])
    with pytest.raises(ValueError, match="truncated or corrupted"):
        eqrope.from_hf_llama(tmp_path / "c")
    write_hf_dir(tmp_path / "d", BASE, random_hf_tensors(BASE))
    (tmp_path / "d" / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        eqrope.from_hf_llama(tmp_path / "d")



def _point_shard_at(directory, where):
    """Move the second shard to `where` and point the index entry at it."""
    shard = "model-00002-of-00002.safetensors"
    index_file = directory / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    where.write_bytes((directory / shard).read_bytes())
    (directory / shard).unlink()
    return index_file, index, shard


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_shard_outside_the_directory_is_refused(tmp_path, how):
    directory = write_hf_dir(tmp_path / "ckpt", BASE, random_hf_tensors(BASE), shards=2)
    outside = tmp_path / "outside.safetensors"
    index_file, index, shard = _point_shard_at(directory, outside)
    if how == "dotdot":
        entry = "../outside.safetensors"
    elif how == "absolute":
        entry = str(outside)
    else:
        entry = "inside.safetensors"
        (directory / entry).symlink_to(outside)
    index["weight_map"] = {n: entry if f == shard else f for n, f in index["weight_map"].items()}
    index_file.write_text(json.dumps(index))
    with pytest.raises(ValueError, match="outside the checkpoint directory") as info:
        eqrope.from_hf_llama(directory)
    assert info.match(f"'{entry}'") and info.match("model.safetensors.index.json")


def test_shard_inside_a_subdirectory_is_read(tmp_path):
    tensors = random_hf_tensors(BASE)
    directory = write_hf_dir(tmp_path / "ckpt", BASE, tensors, shards=2)
    (directory / "weights").mkdir()
    index_file, index, shard = _point_shard_at(directory, directory / "weights" / "b.safetensors")
    index["weight_map"] = {
        n: "weights/b.safetensors" if f == shard else f for n, f in index["weight_map"].items()
    }
    index_file.write_text(json.dumps(index))
    single = eqrope.from_hf_llama(write_hf_dir(tmp_path / "single", BASE, tensors))
    moved = eqrope.from_hf_llama(directory)
    for a, b in zip(jax.tree_util.tree_leaves(single), jax.tree_util.tree_leaves(moved)):
        assert bool((a == b).all())


def test_hub_cache_snapshot_with_links_to_blobs_is_read(tmp_path):
    """The Hugging Face hub cache links `<repo>/snapshots/<rev>/*` to `<repo>/blobs/`."""
    tensors = random_hf_tensors(BASE)
    plain = write_hf_dir(tmp_path / "plain", BASE, tensors, shards=2)
    snapshot, blobs = tmp_path / "repo" / "snapshots" / "abc123", tmp_path / "repo" / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, file in enumerate(sorted(plain.iterdir())):
        (blobs / f"blob{i}").write_bytes(file.read_bytes())
        (snapshot / file.name).symlink_to(f"../../blobs/blob{i}")
    leaves = [jax.tree_util.tree_leaves(eqrope.from_hf_llama(d)) for d in (plain, snapshot)]
    assert all(bool((a == b).all()) for a, b in zip(*leaves))


_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize(
    "change, field",
    [
        ({"num_attention_heads": 0}, "num_attention_heads"),
        ({"num_attention_heads": 4.0}, "num_attention_heads"),
        ({"hidden_size": "32"}, "hidden_size"),
        ({"hidden_size": -64}, "hidden_size"),
        ({"vocab_size": True}, "vocab_size"),
        ({"num_hidden_layers": 0}, "num_hidden_layers"),
        ({"intermediate_size": 96.5}, "intermediate_size"),
        ({"max_position_embeddings": "128"}, "max_position_embeddings"),
        ({"num_key_value_heads": 0}, "num_key_value_heads"),
        ({"num_key_value_heads": "2"}, "num_key_value_heads"),
        ({"head_dim": "16"}, "head_dim"),
        ({"rope_theta": None}, "rope_theta"),
        ({"rope_theta": "1e4"}, "rope_theta"),
        ({"rope_theta": float("inf")}, "rope_theta"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": None}}, "rope_theta"),
        ({"rms_norm_eps": None}, "rms_norm_eps"),
        ({"rms_norm_eps": "1e-6"}, "rms_norm_eps"),
        ({"rms_norm_eps": float("nan")}, "rms_norm_eps"),
        ({"tie_word_embeddings": "false"}, "tie_word_embeddings"),
        ({"attention_bias": "false"}, "attention_bias"),
        ({"mlp_bias": 0}, "mlp_bias"),
        ({"partial_rotary_factor": "1"}, "partial_rotary_factor"),
        ({"rope_scaling": {"rope_type": "linear", "factor": "2"}}, "factor"),
        ({"rope_scaling": {"rope_type": "linear", "factor": None}}, "factor"),
        ({"rope_scaling": {**_LLAMA3, "low_freq_factor": None}}, "low_freq_factor"),
        ({"rope_scaling": {**_LLAMA3, "high_freq_factor": True}}, "high_freq_factor"),
        ({"rope_scaling": {**_LLAMA3, "original_max_position_embeddings": 0}},
         "original_max_position_embeddings"),
        ({"rope_scaling": _LLAMA3, "original_max_position_embeddings": "64"},
         "original_max_position_embeddings"),
        ({"rope_scaling": {**_LLAMA3, "attention_factor": "1"}}, "attention_factor"),
    ],
)
def test_config_numbers_of_the_wrong_type_or_range(tmp_path, change, field):
    """Each raised ZeroDivisionError, TypeError or nothing; now a ValueError naming both."""
    write_hf_dir(tmp_path, {**BASE, **change}, random_hf_tensors(BASE))
    with pytest.raises(ValueError, match=field) as info:
        eqrope.from_hf_llama(tmp_path)
    assert str(tmp_path / "config.json") in str(info.value)


