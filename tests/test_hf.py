"""Hugging Face Llama import and export.

Two kinds of proof:

- without torch: Llama directories written here with `safetensors.numpy`, loaded by
  `eqrope.from_hf_llama`, against a float64 numpy Llama written below with the
  rotate-half pairing, raw (out, in) weights and Meta's llama3 frequency rule;
- against transformers itself (tests marked `hf`, skipped when it is not installed):
  random tiny `LlamaForCausalLM` models saved with `save_pretrained`, logits within 1e-4
  and 50 identical greedy tokens, and eqrope -> `to_hf_llama` -> `from_pretrained`.
"""

import json
import math
import runpy
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

import eqrope


# Every Llama variant the converter supports: (name, extra HF config fields).
CONFIGS = {
    "mha": {},
    "gqa": {"num_key_value_heads": 2},
    "mqa": {"num_key_value_heads": 1},
    "theta1e6": {"rope_theta": 1e6},
    "tied": {"tie_word_embeddings": True},
    "llama3": {
        "num_key_value_heads": 2,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    "linear": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
}
BASE = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
)


# -- an independent numpy Llama (rotate-half, HF weight layout) -------------------------


def reference_inv_freq(head_dim: int, hf: dict) -> np.ndarray:
    """The rates in float64; llama3 as the loop in Meta's Llama 3.1 `apply_scaling`."""
    theta = hf.get("rope_theta", 10000.0)
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    scaling = hf.get("rope_scaling")
    if scaling is None:
        return freqs
    if scaling["rope_type"] == "linear":
        return freqs / scaling["factor"]
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(freq)
        elif wavelen > old / low:
            out.append(freq / factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return np.array(out)


def rotate_half_rope(x, positions, inv_freq):
    """HF's `apply_rotary_pos_emb`: dimension i rotates with i + head_dim/2."""
    angles = positions[:, None] * inv_freq[None, :]
    emb = np.concatenate([angles, angles], axis=-1)[:, None, :]
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * np.cos(emb) + rotated * np.sin(emb)


def reference_logits(t: dict, hf: dict, ids: np.ndarray) -> np.ndarray:
    """`LlamaForCausalLM` logits in float64 from the raw HF tensors `t`."""
    t = {k: np.asarray(v, np.float64) for k, v in t.items()}
    n_heads = hf["num_attention_heads"]
    n_kv = hf.get("num_key_value_heads", n_heads)
    hd = hf["hidden_size"] // n_heads
    eps = hf["rms_norm_eps"]
    inv_freq = reference_inv_freq(hd, hf)
    seq = len(ids)
    positions = np.arange(seq, dtype=np.float64)

    def rms(x, w):
        return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * w

    x = t["model.embed_tokens.weight"][ids]
    causal = np.tril(np.ones((seq, seq), bool))
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, t[p + "input_layernorm.weight"])
        q = (h @ t[p + "self_attn.q_proj.weight"].T).reshape(seq, n_heads, hd)
        k = (h @ t[p + "self_attn.k_proj.weight"].T).reshape(seq, n_kv, hd)
        v = (h @ t[p + "self_attn.v_proj.weight"].T).reshape(seq, n_kv, hd)
        q, k = rotate_half_rope(q, positions, inv_freq), rotate_half_rope(k, positions, inv_freq)
        k, v = np.repeat(k, n_heads // n_kv, axis=1), np.repeat(v, n_heads // n_kv, axis=1)
        s = np.einsum("shd,thd->hst", q, k) / math.sqrt(hd)
        s = np.where(causal, s, -np.inf)
        w = np.exp(s - s.max(-1, keepdims=True))
        w = w / w.sum(-1, keepdims=True)
        o = np.einsum("hst,thd->shd", w, v).reshape(seq, n_heads * hd)
        x = x + o @ t[p + "self_attn.o_proj.weight"].T
        h = rms(x, t[p + "post_attention_layernorm.weight"])
        gate, up = h @ t[p + "mlp.gate_proj.weight"].T, h @ t[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ t[p + "mlp.down_proj.weight"].T
    x = rms(x, t["model.norm.weight"])
    head = t["model.embed_tokens.weight"] if hf.get("tie_word_embeddings") else t["lm_head.weight"]
    return x @ head.T


def random_hf_tensors(hf: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights in the HF layout and names (norm weights around 1)."""
    rng = np.random.default_rng(seed)
    d, ff, vocab = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"]
    n_heads = hf["num_attention_heads"]
    hd = d // n_heads
    n_kv = hf.get("num_key_value_heads", n_heads)
    shapes = {"model.embed_tokens.weight": (vocab, d), "model.norm.weight": (d,)}
    if not hf.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (vocab, d)
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (n_heads * hd, d),
            p + "self_attn.k_proj.weight": (n_kv * hd, d),
            p + "self_attn.v_proj.weight": (n_kv * hd, d),
            p + "self_attn.o_proj.weight": (d, n_heads * hd),
            p + "mlp.gate_proj.weight": (ff, d),
            p + "mlp.up_proj.weight": (ff, d),
            p + "mlp.down_proj.weight": (d, ff),
        })
    return {
        name: ((1.0 if len(s) == 1 else 0.0) + 0.3 * rng.standard_normal(s)).astype(np.float32)
        for name, s in shapes.items()
    }


def write_hf_dir(path, hf: dict, tensors: dict, *, shards: int = 1):
    """A Llama directory as `save_pretrained` writes it, with numpy only."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", **hf}))
    if shards == 1:
        safetensors.numpy.save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        shard = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        safetensors.numpy.save_file(part, str(path / shard), metadata={"format": "pt"})
        weight_map.update({n: shard for n in part})
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path


def _ids(n, vocab, seed=1):
    return np.random.default_rng(seed).integers(0, vocab, n)


# -- the pairing, without torch -----------------------------------------------------------


@pytest.mark.parametrize("head_dim, base", [(2, 10000.0), (8, 10000.0), (16, 1e6), (64, 500000.0)])
def test_pairing_permutation_turns_rotate_half_into_interleaved(head_dim, base):
    """apply_rope(hf[perm]) == rotate_half_rope(hf)[perm], head by head, and q.k unchanged."""
    rng = np.random.default_rng(head_dim)
    n_heads, seq = 3, 11
    q = rng.standard_normal((seq, n_heads, head_dim)).astype(np.float32)
    k = rng.standard_normal((seq, n_heads, head_dim)).astype(np.float32)
    positions = np.arange(seq) * 7
    inv_freq = np.asarray(eqrope.rope_inv_freq(head_dim, base), np.float64)
    perm = eqrope.weights._hf.pairing_permutation(1, head_dim)
    half = head_dim // 2
    assert perm.tolist() == [j for i in range(half) for j in (i, i + half)]

    def ours(x):
        rotated = eqrope.apply_rope(
            jnp.asarray(x[..., perm]),
            jnp.asarray(positions, jnp.int32),
            jnp.asarray(inv_freq, jnp.float32),
        )
        return np.asarray(rotated)

    theirs_q = rotate_half_rope(q.astype(np.float64), positions, inv_freq)
    theirs_k = rotate_half_rope(k.astype(np.float64), positions, inv_freq)
    np.testing.assert_allclose(ours(q), theirs_q[..., perm], atol=2e-5)
    scores_ours = np.einsum("shd,thd->hst", ours(q), ours(k))
    scores_theirs = np.einsum("shd,thd->hst", theirs_q, theirs_k)
    np.testing.assert_allclose(scores_ours, scores_theirs, atol=1e-4)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_import_matches_numpy_llama(tmp_path, name, monkeypatch):
    """Interleaved pairing + permuted weights == rotate-half pairing + raw weights."""
    hf = {**BASE, **CONFIGS[name]}
    tensors = random_hf_tensors(hf)
    write_hf_dir(tmp_path, hf, tensors)
    monkeypatch.setitem(sys.modules, "torch", None)  # any `import torch` now fails
    model = eqrope.from_hf_llama(tmp_path)
    assert model.config.head_bias is False and model.head_bias is None
    assert model.config.tie_embeddings == bool(hf.get("tie_word_embeddings"))
    assert model.config.n_kv_heads == hf.get("num_key_value_heads", 4)
    ids = _ids(40, hf["vocab_size"])
    ours = np.asarray(eqx.filter_jit(model)(jnp.asarray(ids, jnp.int32)))
    np.testing.assert_allclose(ours, reference_logits(tensors, hf, ids), atol=1e-4, rtol=0)


def test_llama3_rates_follow_meta_rule():
    """eqrope's llama3 rescaling against Meta's loop, with every regime present."""
    hf = {"model_type": "llama", **BASE, **CONFIGS["llama3"]}
    scaling = eqrope.weights._hf_config.decoder_config(hf, "test", "float32", None).rope_scaling
    for head_dim in (16, 64, 128):
        ref = reference_inv_freq(head_dim, hf)
        base = reference_inv_freq(head_dim, {})
        kept, divided = np.isclose(ref, base), np.isclose(ref, base / 8)
        assert kept.any() and divided.any() and (~kept & ~divided).any()
        ours = np.asarray(eqrope.rope_inv_freq(head_dim, 10000.0, scaling))
        np.testing.assert_allclose(ours, ref, rtol=2e-6)


def test_sharded_checkpoint_equals_single_file(tmp_path):
    hf = {**BASE, **CONFIGS["gqa"]}
    tensors = random_hf_tensors(hf, seed=5)
    single = eqrope.from_hf_llama(write_hf_dir(tmp_path / "single", hf, tensors))
    sharded = eqrope.from_hf_llama(write_hf_dir(tmp_path / "sharded", hf, tensors, shards=3))
    for a, b in zip(jax.tree_util.tree_leaves(single), jax.tree_util.tree_leaves(sharded)):
        assert a.dtype == b.dtype and bool((a == b).all())


def test_legacy_config_fields_and_dtype(tmp_path):
    """transformers 4 wrote `rope_theta` + `rope_scaling` with "type"; 5 writes `rope_parameters`."""
    legacy = {**BASE, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 4.0}}
    modern = {**BASE, "rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 5e5}}
    tensors = random_hf_tensors(BASE)
    a = eqrope.from_hf_llama(write_hf_dir(tmp_path / "a", legacy, tensors))
    b = eqrope.from_hf_llama(write_hf_dir(tmp_path / "b", modern, tensors), dtype=jnp.bfloat16)
    assert a.config.rope_scaling == b.config.rope_scaling == eqrope.RopeScaling("linear", 4.0)
    assert a.config.rope_base == b.config.rope_base == 5e5
    assert a.config.norm_eps == 1e-6 and a.config.max_len == 128 and a.config.d_ff == 96
    assert a.embed.dtype == jnp.float32 and b.embed.dtype == jnp.bfloat16
    assert b.config.dtype == "bfloat16"


# -- refusals --------------------------------------------------------------------------


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


# -- export, without torch ---------------------------------------------------------------


def _eqrope_model(seed=0, **kwargs):
    sizes = dict(vocab_size=61, d_model=32, n_heads=4, n_blocks=2, max_len=96)
    shapes = eqx.filter_eval_shape(eqrope.RotaryDecoder, **sizes, key=jax.random.PRNGKey(0), **kwargs)
    rng = np.random.default_rng(seed)
    leaves, treedef = jax.tree_util.tree_flatten(shapes)
    new = [jnp.asarray((0.3 * rng.standard_normal(a.shape)).astype(a.dtype)) for a in leaves]
    return jax.tree_util.tree_unflatten(treedef, new)


EXPORT_VARIANTS = {
    "mha": dict(head_bias=False),
    "gqa-llama3": dict(
        head_bias=False, n_kv_heads=2, rope_scaling=eqrope.RopeScaling("llama3", 4.0, original_max_len=32)
    ),
    "mqa-tied-linear": dict(
        head_bias=False, n_kv_heads=1, tie_embeddings=True, rope_scaling=eqrope.RopeScaling("linear", 3.0)
    ),
}


@pytest.mark.parametrize("name", sorted(EXPORT_VARIANTS))
def test_export_then_import_is_bitwise(tmp_path, name):
    model = _eqrope_model(**EXPORT_VARIANTS[name])
    eqrope.to_hf_llama(model, tmp_path)
    back = eqrope.from_hf_llama(tmp_path)  # the decoding layout (tests/test_checkpoint.py)
    assert back.config == model.config
    for a, b in zip(jax.tree_util.tree_leaves(model.with_layout(back.layout)), jax.tree_util.tree_leaves(back)):
        assert a.dtype == b.dtype and bool((a == b).all())


def test_exported_weights_run_in_numpy_llama(tmp_path):
    """The exported tensors, read by the rotate-half reference, give eqrope's logits."""
    model = _eqrope_model(**EXPORT_VARIANTS["gqa-llama3"])
    eqrope.to_hf_llama(model, tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    hf["rope_scaling"] = hf["rope_parameters"] if hf["rope_parameters"]["rope_type"] != "default" else None
    tensors = safetensors.numpy.load_file(str(tmp_path / "model.safetensors"))
    ids = _ids(30, 61)
    ours = np.asarray(eqx.filter_jit(model)(jnp.asarray(ids, jnp.int32)))
    np.testing.assert_allclose(ours, reference_logits(tensors, hf, ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(norm="layer"), "norm='layer'"),
        (dict(mlp="gelu"), "mlp='gelu'"),
        (dict(positions="learned"), "positions='learned'"),
        (dict(bias=True, attention=eqrope.AttentionOptions(qk_norm=True)), "bias=True.*no Hugging Face family"),
        (dict(attention=eqrope.AttentionOptions(window=4, window_blocks=(1,))), "some blocks only"),
        (dict(attention=eqrope.AttentionOptions(out_bias=True)), "output bias without"),
        (dict(attention=eqrope.AttentionOptions(qk_norm=True, qkv_bias=True)), "Qwen3.*alike"),
    ],
)
def test_export_refuses_models_no_family_expresses(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match="to_hf: .*" + message):
        eqrope.to_hf_llama(_eqrope_model(**kwargs), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_export_head_bias(tmp_path):
    model = _eqrope_model()  # head_bias=True, random (non-zero)
    with pytest.raises(ValueError, match="head_bias is not zero.*drop_head_bias=True"):
        eqrope.to_hf_llama(model, tmp_path / "a")
    eqrope.to_hf_llama(model, tmp_path / "b", drop_head_bias=True)
    dropped = eqrope.from_hf_llama(tmp_path / "b")
    ids = jnp.arange(9, dtype=jnp.int32)
    np.testing.assert_allclose(dropped(ids), model(ids) - model.head_bias, atol=1e-5)
    zero = eqx.tree_at(lambda m: m.head_bias, model, jnp.zeros_like(model.head_bias))
    eqrope.to_hf_llama(zero, tmp_path / "c")  # a zero bias is dropped exactly
    np.testing.assert_allclose(eqrope.from_hf_llama(tmp_path / "c")(ids), zero(ids), atol=1e-5)


def test_export_refuses_to_overwrite_a_checkpoint(tmp_path):
    model = _eqrope_model(head_bias=False)
    eqrope.save(tmp_path, model)
    with pytest.raises(FileExistsError, match="holds an eqrope checkpoint"):
        eqrope.to_hf_llama(model, tmp_path)
    assert eqrope.load(tmp_path).config == model.config


# -- against transformers ------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_lib():
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    return transformers, torch


def _hf_random_model(hf_lib, hf: dict, seed: int = 0, classes=("LlamaConfig", "LlamaForCausalLM")):
    """transformers' model (`classes`: its config and model class names) with every
    weight drawn at random, norms and biases around 1 rather than at their init."""
    transformers, torch = hf_lib
    config_cls, model_cls = (getattr(transformers, name) for name in classes)
    torch.manual_seed(seed)
    config = config_cls(**hf, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = model_cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.ndim == 1 else 0.0))
    return model


def _hf_logits(hf_lib, model, ids):
    _, torch = hf_lib
    with torch.no_grad():
        return model(torch.tensor(np.asarray(ids))[None]).logits[0].double().numpy()


@pytest.mark.hf
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_transformers_checkpoint_loads(tmp_path, hf_lib, name, record_property):
    _, torch = hf_lib
    hf = {**BASE, **CONFIGS[name]}
    theirs = _hf_random_model(hf_lib, hf)
    theirs.save_pretrained(tmp_path, safe_serialization=True)
    ours = eqrope.from_hf_llama(tmp_path)

    ids = _ids(60, hf["vocab_size"])
    ours_logits = np.asarray(eqx.filter_jit(ours)(jnp.asarray(ids, jnp.int32)))
    diff = np.abs(ours_logits - _hf_logits(hf_lib, theirs, ids))
    record_property("max_abs_logit_diff", float(diff.max()))
    print(f"{name}: max |logit diff| = {diff.max():.3g}")
    assert diff.max() < 1e-4

    # The rotation rates themselves, against transformers' rope initialisers.
    c = ours.config
    np.testing.assert_allclose(
        np.asarray(eqrope.rope_inv_freq(c.head_dim, c.rope_base, c.rope_scaling)),
        theirs.model.rotary_emb.inv_freq.numpy(),
        rtol=1e-6,
    )

    prompt = _ids(8, hf["vocab_size"], seed=2)
    with torch.no_grad():
        expected = theirs.generate(torch.tensor(prompt)[None], max_new_tokens=50, do_sample=False)
    expected = expected[0].numpy()
    got = np.asarray(eqrope.generate(ours, jnp.asarray(prompt, jnp.int32), 50))
    assert expected.shape == (58,)
    assert got.tolist() == expected.tolist()


@pytest.mark.hf
def test_transformers_sharded_checkpoint(tmp_path, hf_lib):
    hf = {**BASE, **CONFIGS["gqa"]}
    theirs = _hf_random_model(hf_lib, hf, seed=1)
    theirs.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    ours = eqrope.from_hf_llama(tmp_path)
    ids = _ids(20, hf["vocab_size"])
    ours_logits = np.asarray(eqx.filter_jit(ours)(jnp.asarray(ids, jnp.int32)))
    assert np.abs(ours_logits - _hf_logits(hf_lib, theirs, ids)).max() < 1e-4


@pytest.mark.hf
@pytest.mark.parametrize("name", sorted(EXPORT_VARIANTS))
def test_export_loads_in_transformers(tmp_path, hf_lib, name):
    transformers, _ = hf_lib
    model = _eqrope_model(**EXPORT_VARIANTS[name])
    eqrope.to_hf_llama(model, tmp_path)
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert theirs.config.num_key_value_heads == model.config.n_kv_heads
    ids = _ids(50, 61)
    ours = np.asarray(eqx.filter_jit(model)(jnp.asarray(ids, jnp.int32)))
    diff = np.abs(_hf_logits(hf_lib, theirs, ids) - ours)
    print(f"export {name}: max |logit diff| = {diff.max():.3g}")
    assert diff.max() < 1e-4


@pytest.mark.hf
def test_benchmark_script_runs(tmp_path, hf_lib, monkeypatch):
    """bench/vs_transformers.py --tiny: runs, writes its JSON, and all contenders agree."""
    bench = Path(__file__).resolve().parent.parent / "bench"
    monkeypatch.syspath_prepend(str(bench))  # as `python bench/vs_transformers.py` has it
    script = runpy.run_path(str(bench / "vs_transformers.py"), run_name="vs_transformers")
    result = script["main"](["--tiny", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "vs_transformers_cpu.json").read_text())["mode"] == "tiny"
    rows = [row for case in result["cases"] for row in case["rows"]]
    assert [case["case"] for case in result["cases"]] == ["seed", "chapter"]
    assert all(row["all_full_length"] for row in rows)
    assert all(all(row["identical_tokens"].values()) for row in rows)
    assert len(rows[0]["identical_tokens"]) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vs_transformers_cpu.json"]
