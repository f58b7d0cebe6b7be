"""Nothing silent, round 3 (issue 27): the defects that concern files on disk.

Every field read from config.json is checked for type and range and named by its key in
that file; a key the file leaves out means what transformers' config class makes of it;
and a save into a directory this user cannot write raises before anything is written.
tokenizer_config.json and generation_config.json: tests/test_silent_round3_tokenizer.py.

Each test names the item of the issue it pins. Checkpoints are written by hand
(tests/_hf_llama.py) or by transformers' own classes (tests marked `hf`). Nothing is
downloaded.
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
