"""Hugging Face Llama import and export.

Two kinds of proof:

- without torch: Llama directories written here with `safetensors.numpy`, loaded by
  `eqrope.from_hf_llama`, against a float64 numpy Llama (tests/_hf_llama.py) with the
  rotate-half pairing, raw (out, in) weights and Meta's llama3 frequency rule;
- against transformers itself (tests marked `hf`, skipped when it is not installed):
  random tiny `LlamaForCausalLM` models saved with `save_pretrained`, logits within 1e-4
  and 50 identical greedy tokens, and eqrope -> `to_hf_llama` -> `from_pretrained`.

The checkpoints it refuses are in tests/test_hf_refusals.py.
"""

import json
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
from _hf_llama import (  # noqa: F401 (hf_lib is a fixture)
    BASE, CONFIGS, _eqrope_model, _hf_logits, _hf_random_model, _ids, hf_lib, random_hf_tensors,
    reference_inv_freq, reference_logits, rotate_half_rope, write_hf_dir,
)  # fmt: skip


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


# -- export, without torch ---------------------------------------------------------------


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
