"""eqrope.save / eqrope.load: bitwise round trips, a save that is all or nothing, committed
checkpoints that load. Damaged or mismatched checkpoints: tests/test_checkpoint_damage.py."""

import json
import os
import pickle
import struct
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

import eqrope


pytestmark = pytest.mark.usefixtures("precision")

SIZES = (17, 16, 2, 2, 32)
VARIANTS = {
    "seed": {},
    "bf16-gqa-tied-llama3": dict(
        dtype=jnp.bfloat16,
        n_kv_heads=1,
        tie_embeddings=True,
        head_bias=False,
        rope_scaling=eqrope.RopeScaling("llama3", 4.0, original_max_len=16),
    ),
    "textbook": dict(positions="learned", norm="layer", mlp="gelu", bias=True, d_ff=24),
    "float16-linear": dict(
        dtype=jnp.float16, rope_scaling=eqrope.RopeScaling("linear", 2.0), norm_eps=1e-6
    ),
}


def _model(seed=0, **kwargs):
    """A random model: every array random (norms and biases too), so a swapped array shows.

    Built from its shapes (`eqx.filter_eval_shape`), which is much faster than running
    the initialisers eagerly.
    """
    shapes = eqx.filter_eval_shape(
        lambda: eqrope.RotaryDecoder(*SIZES, key=jax.random.PRNGKey(3), **kwargs)
    )
    return _randomise(shapes, seed)


def _randomise(model, seed=0):
    rng = np.random.default_rng(seed)
    leaves, treedef = jax.tree_util.tree_flatten(model)
    new = [jnp.asarray(rng.standard_normal(a.shape).astype(a.dtype)) for a in leaves]
    return jax.tree_util.tree_unflatten(treedef, new)


def _bytes_equal(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_round_trip_is_bitwise(tmp_path, variant):
    model = _model(**VARIANTS[variant])
    eqrope.save(tmp_path / "ckpt", model)
    # `load` gives the decoding layout unless asked: unstacked, stacked for bfloat16 and
    # float16 on the CPU; the file holds the stacked one.
    low_on_cpu = model.config.dtype in ("bfloat16", "float16") and jax.default_backend() == "cpu"
    default = "stacked" if low_on_cpu else "unstacked"
    for layout, loaded in ((default, eqrope.load(tmp_path / "ckpt")),
                           ("stacked", eqrope.load(tmp_path / "ckpt", layout="stacked")),
                           ("unstacked", eqrope.load(tmp_path / "ckpt", layout="unstacked"))):  # fmt: skip
        expected = model.with_layout(layout)
        assert type(loaded) is eqrope.RotaryDecoder and loaded.layout == layout
        assert loaded.config == model.config
        # Same tree structure (static fields included) and the same bytes in every array.
        assert jax.tree_util.tree_structure(loaded) == jax.tree_util.tree_structure(expected)
        pairs = zip(jax.tree_util.tree_leaves(expected), jax.tree_util.tree_leaves(loaded))
        assert all(_bytes_equal(a, b) for a, b in pairs)


def test_file_layout_is_json_plus_safetensors(tmp_path):
    model = _model()
    eqrope.save(tmp_path, model)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["format"] == "eqrope-checkpoint" and config["format_version"] == 2
    assert config["config"] == model.config.to_dict()
    raw = (tmp_path / "model.safetensors").read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + header_len])
    names = sorted(k for k in header if k != "__metadata__")
    assert names == sorted(
        ["embed", "blocks.attn_norm.weight", "blocks.attn.wqkv", "blocks.attn.wo",
         "blocks.mlp_norm.weight", "blocks.mlp.w_gate_up", "blocks.mlp.w_down",
         "final_norm.weight", "head", "head_bias"]
    )
    # The stored bytes are the arrays themselves (independent of eqrope's reader).
    arrays = safetensors.numpy.load(raw)
    assert _bytes_equal(arrays["blocks.attn.wqkv"], model.blocks.attn.wqkv)


def test_load_never_unpickles(tmp_path, monkeypatch):
    eqrope.save(tmp_path, _model())

    def forbidden(*args, **kwargs):
        raise AssertionError("a checkpoint must never be unpickled")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, forbidden)
    monkeypatch.setattr(np, "load", forbidden)
    eqrope.load(tmp_path)


def test_save_overwrites_an_earlier_checkpoint(tmp_path):
    eqrope.save(tmp_path, _model())
    second = _model(seed=7)
    eqrope.save(tmp_path, second)
    assert _bytes_equal(eqrope.load(tmp_path).embed, second.embed)
    assert not list(tmp_path.glob("*.tmp"))


# -- a save is all or nothing, and the two files are bound together ----------------------


def _saved_bytes(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_numpy_scalars_in_the_config_save_as_plain_json(tmp_path, unchecked):
    """The issue's reproduction: np.float32(5e5) used to fail after the arrays were written."""
    directory = eqrope.save(tmp_path / "ckpt", _model())
    new = _model(seed=1, rope_base=np.float32(5e5), norm_eps=np.float64(1e-6))
    assert type(new.config.rope_base) is float and new.config.rope_base == 500000.0
    eqrope.save(directory, new)
    loaded = eqrope.load(directory)
    assert loaded.config == new.config and loaded.config.rope_base == 500000.0
    assert _bytes_equal(loaded.embed, new.embed)
    stored = json.loads((directory / "config.json").read_text())["config"]
    assert stored["rope_base"] == 500000.0 and stored["norm_eps"] == 1e-6


def test_failed_serialisation_leaves_the_old_checkpoint(tmp_path, monkeypatch):
    directory = eqrope.save(tmp_path / "ckpt", _model())
    (directory / "notes.txt").write_text("mine")
    before = _saved_bytes(directory)

    def broken(*args, **kwargs):
        raise TypeError("not JSON serialisable")

    monkeypatch.setattr(json, "dumps", broken)
    with pytest.raises(TypeError, match="not JSON serialisable"):
        eqrope.save(directory, _model(seed=1, rope_base=5e5))
    monkeypatch.undo()
    assert _saved_bytes(directory) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary left


def test_failed_rename_leaves_the_old_checkpoint(tmp_path, monkeypatch):
    """A failure at the last moment (the second rename) restores the old directory."""
    directory = eqrope.save(tmp_path / "ckpt", _model())
    (directory / "notes.txt").write_text("mine")
    before = _saved_bytes(directory)
    real_replace, calls = os.replace, []

    def flaky(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:
            raise OSError("disk full")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", flaky)
    with pytest.raises(OSError, match="disk full"):
        eqrope.save(directory, _model(seed=1, rope_base=5e5))
    monkeypatch.undo()
    assert _saved_bytes(directory) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert eqrope.load(directory).config.rope_base == 10000.0


def test_overwrite_keeps_other_files_in_the_directory(tmp_path):
    directory = eqrope.save(tmp_path / "ckpt", _model())
    (directory / "train.json").write_text("{}")
    eqrope.save(directory, _model(seed=1))
    assert sorted(p.name for p in directory.iterdir()) == [
        "config.json", "model.safetensors", "train.json"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_arrays_from_another_save_are_refused(tmp_path):
    """Same shapes, different config: the pair used to load silently with the wrong config."""
    a = eqrope.save(tmp_path / "a", _model())
    b = eqrope.save(tmp_path / "b", _model(seed=1, rope_base=5e5))
    (a / "model.safetensors").write_bytes((b / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="do not belong together") as info:
        eqrope.load(a)
    assert info.match(r"config\.json") and info.match(r"model\.safetensors")
    assert info.match("SHA-256")


def test_an_arrays_file_without_the_config_hash_is_refused(tmp_path):
    eqrope.save(tmp_path, _model())
    file = tmp_path / "model.safetensors"
    with safetensors.safe_open(str(file), framework="numpy") as f:
        metadata = {k: v for k, v in f.metadata().items() if k != "config_sha256"}
        arrays = {name: f.get_tensor(name) for name in f.keys()}
    safetensors.numpy.save_file(arrays, str(file), metadata=metadata)
    with pytest.raises(ValueError, match="no SHA-256 of its config"):
        eqrope.load(tmp_path)


def test_format_version_1_still_loads(tmp_path):
    """Version 1 (no config hash) as the committed experiment checkpoints are written."""
    model = _model()
    eqrope.save(tmp_path, model)
    file = tmp_path / "model.safetensors"
    with safetensors.safe_open(str(file), framework="numpy") as f:
        metadata = {k: v for k, v in f.metadata().items() if k != "config_sha256"}
        arrays = {name: f.get_tensor(name) for name in f.keys()}
    metadata["format_version"] = "1"
    safetensors.numpy.save_file(arrays, str(file), metadata=metadata)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "format_version": 1}))
    assert _bytes_equal(eqrope.load(tmp_path).head, model.head)


COMMITTED = sorted(Path(__file__).resolve().parent.parent.glob("experiments/checkpoints/*/*"))


@pytest.mark.parametrize("directory", COMMITTED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_committed_experiment_checkpoints_load(directory):
    model = eqrope.load(directory)
    # The reversal task's 12 symbols; the Markov language of experiments/extrapolation.py
    # has 16 (experiments/extrapolation_markov.py).
    assert model.config.vocab_size == (16 if directory.name.startswith("markov_") else 12)
    assert model.embed.shape[0] == model.config.vocab_size
