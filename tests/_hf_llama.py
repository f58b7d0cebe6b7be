"""Llama checkpoints for the tests, without torch and with it: the configs the converter
supports, an independent float64 numpy Llama (rotate-half pairing, Hugging Face's weight
layout, Meta's llama3 frequency rule), random checkpoints written with `safetensors.numpy`,
a random eqrope model to export, and (fixture `hf_lib`, skipped without them) transformers'
random models and their logits.
"""

import json
import math

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


def _eqrope_model(seed=0, **kwargs):
    sizes = dict(vocab_size=61, d_model=32, n_heads=4, n_blocks=2, max_len=96)
    shapes = eqx.filter_eval_shape(eqrope.RotaryDecoder, **sizes, key=jax.random.PRNGKey(0), **kwargs)
    rng = np.random.default_rng(seed)
    leaves, treedef = jax.tree_util.tree_flatten(shapes)
    new = [jnp.asarray((0.3 * rng.standard_normal(a.shape)).astype(a.dtype)) for a in leaves]
    return jax.tree_util.tree_unflatten(treedef, new)


# -- transformers' side -----------------------------------------------------------------


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
