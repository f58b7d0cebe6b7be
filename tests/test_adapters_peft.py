"""eqrope's adapters against PEFT's, on a tiny Llama and a tiny Qwen3 built with
transformers' config classes (marked `hf`; skipped without peft).

- Out: an eqrope adapter with non-zero A and B, written by `eqrope.to_peft` and read by
  `peft.PeftModel.from_pretrained` on the transformers base, gives eqrope's logits
  within 1e-4 (relative) and the same greedy tokens.
- In: an adapter created in peft, perturbed and saved, read by `eqrope.from_peft`, the same.
- What eqrope cannot express, and damaged files, are refused by name.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

import eqrope
from _adapters import ALL, call, perturbed
from _hf_llama import _hf_logits, _hf_random_model, hf_lib  # noqa: F401 (hf_lib is a fixture)


# peft 0.21 calls an attribute transformers 5 deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
SIZES = dict(
    vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
)  # fmt: skip
FAMILIES = {
    "llama": (("LlamaConfig", "LlamaForCausalLM"), {}),
    "qwen3": (("Qwen3Config", "Qwen3ForCausalLM"), dict(head_dim=16)),
}


@pytest.fixture(scope="module")
def peft():
    return pytest.importorskip("peft")


def _pair(hf_lib, family, tmp_path):
    classes, extra = FAMILIES[family]
    theirs = _hf_random_model(hf_lib, {**SIZES, **extra}, classes=classes)
    theirs.save_pretrained(tmp_path / "base", safe_serialization=True)
    return eqrope.from_hf(tmp_path / "base"), tmp_path / "base", classes[1]


def _fresh(hf_lib, path, cls):
    transformers, _ = hf_lib
    return getattr(transformers, cls).from_pretrained(path).eval()


def _compare(hf_lib, ours, theirs, record_property, name):
    _, torch = hf_lib
    ids = np.random.default_rng(1).integers(0, SIZES["vocab_size"], 40)
    expected = _hf_logits(hf_lib, theirs, ids)
    got = np.asarray(call(ours, jnp.asarray(ids, jnp.int32)))
    rel = np.abs(got - expected).max() / np.abs(expected).max()
    record_property(name, float(rel))
    print(f"{name}: max |logit diff| / max |logit| = {rel:.3g}")
    assert rel < 1e-4
    prompt = np.random.default_rng(2).integers(0, SIZES["vocab_size"], 8)
    with torch.no_grad():
        want = theirs.generate(torch.tensor(prompt)[None], max_new_tokens=20, do_sample=False)[0].numpy()
    assert eqrope.generate(ours, jnp.asarray(prompt, jnp.int32), 20).tolist() == want.tolist()


@pytest.mark.hf
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_eqrope_adapter_loads_in_peft(tmp_path, hf_lib, peft, family, record_property):
    base, base_path, cls = _pair(hf_lib, family, tmp_path)
    ours = eqrope.lora(base, rank=4, alpha=16, targets=ALL, rslora=family == "qwen3", key=jax.random.key(0))
    ours = perturbed(ours)
    eqrope.to_peft(ours, tmp_path / "adapter", base_model_name_or_path="tiny")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 16 and config["use_rslora"] == (family == "qwen3")
    assert sorted(config["target_modules"]) == sorted(f"{t}_proj" for t in ALL)
    theirs = peft.PeftModel.from_pretrained(_fresh(hf_lib, base_path, cls), tmp_path / "adapter").eval()
    _compare(hf_lib, ours, theirs, record_property, f"{family} eqrope->peft")
    # And back: from_peft reads the very arrays.
    back = eqrope.from_peft(base, tmp_path / "adapter")
    assert np.array_equal(call(back, jnp.arange(9)), call(ours, jnp.arange(9)))


@pytest.mark.hf
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_peft_adapter_loads_in_eqrope(tmp_path, hf_lib, peft, family, record_property):
    _, torch = hf_lib
    base, base_path, cls = _pair(hf_lib, family, tmp_path)
    targets = ["q_proj", "k_proj", "o_proj", "up_proj", "down_proj"]
    config = peft.LoraConfig(r=3, lora_alpha=5, target_modules=targets, lora_dropout=0.1, use_rslora=family == "llama")
    theirs = peft.get_peft_model(_fresh(hf_lib, base_path, cls), config)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.3)
    theirs.save_pretrained(tmp_path / "adapter")
    ours = eqrope.from_peft(base, tmp_path / "adapter")
    held = ours.stacked()  # from_hf's decoding layout, stacked for the check
    assert held.blocks.attn.wqkv.parts[2] is None and held.blocks.mlp.w_gate_up.parts[0] is None
    _compare(hf_lib, ours, theirs.eval(), record_property, f"{family} peft->eqrope")


def _peft_dir(tmp_path, base, **changes):
    """An adapter directory from eqrope, with its config's fields changed."""
    path = eqrope.to_peft(eqrope.lora(base, rank=2, targets=("q", "v"), key=jax.random.key(0)), tmp_path / "ad")
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, **changes}))
    return path


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(use_dora=True), "use_dora=True: DoRA"),
        (dict(bias="all"), "bias='all': bias training"),
        (dict(modules_to_save=["lm_head"]), "modules_to_save"),
        (dict(target_modules=["q_proj", "c_attn"]), "names 'c_attn', a module this model does not have"),
        (dict(layers_to_transform=[0]), "adapters on some blocks only"),
        (dict(target_modules="model.layers.0.self_attn.(q|v)_proj"), r"in blocks \[0\] only"),
        (dict(rank_pattern={"q_proj": 4}), "per-module ranks"),
        (dict(init_lora_weights="pissa"), "changes the base weights"),
        (dict(r=0), "r must be a positive int"),
        (dict(peft_type="IA3"), "LoRA adapters"),
    ],
)
def test_what_eqrope_cannot_express_is_refused(tmp_path, changes, message):
    base = eqrope.RotaryDecoder(61, 32, 4, 2, 64, n_kv_heads=2, head_bias=False, key=jax.random.key(0))
    with pytest.raises(ValueError, match=message):
        eqrope.from_peft(base, _peft_dir(tmp_path, base, **changes))


def test_damaged_tensors_are_named(tmp_path):
    base = eqrope.RotaryDecoder(61, 32, 4, 2, 64, n_kv_heads=2, head_bias=False, key=jax.random.key(0))
    path = _peft_dir(tmp_path, base)
    # A regular expression and "all-linear" read as PEFT reads them.
    assert eqrope.from_peft(base, _peft_dir(tmp_path, base, target_modules=r".*\.(q|v)_proj")) is not None
    tensors = safetensors.numpy.load_file(str(path / "adapter_model.safetensors"))
    name = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    safetensors.numpy.save_file({k: v for k, v in tensors.items() if k != name}, str(path / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match=f"missing tensor '{name}'"):
        eqrope.from_peft(base, path)
    bad = {**tensors, name: np.zeros((16, 3), np.float32)}
    safetensors.numpy.save_file(bad, str(path / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match=rf"tensor '{name}' has shape \(16, 3\), the base model and r=2 need \(16, 2\)"):
        eqrope.from_peft(base, path)
    other = eqrope.RotaryDecoder(61, 48, 4, 2, 64, n_kv_heads=2, head_bias=False, key=jax.random.key(0))
    safetensors.numpy.save_file(tensors, str(path / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="has shape"):
        eqrope.from_peft(other, path)
