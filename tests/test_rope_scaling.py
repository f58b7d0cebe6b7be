"""Rotary scalings `linear`, `llama3`, `yarn` and `dynamic`.

Pinned against transformers (tests marked `hf`): its rope initialisation functions
(`ROPE_INIT_FUNCTIONS`) give the same rates and attention factor, and tiny random
`LlamaForCausalLM` models with each scaling, loaded with `eqrope.from_hf_llama`, give the
same logits and the same greedy tokens. Without transformers: factor 1 changes nothing,
yarn's rates have the shape the YaRN paper gives them, configs round-trip, and bad
configs are refused by name.
"""

import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqrope
from eqrope.weights._hf_config import decoder_config
from eqrope.model._rope import rope_attention_factor
from _hf_llama import (  # noqa: F401 (hf_lib is a fixture)
    BASE,
    _eqrope_model,
    _hf_logits,
    _hf_random_model,
    _ids,
    hf_lib,
    random_hf_tensors,
    write_hf_dir,
)


LLAMA = {"model_type": "llama", **BASE, "num_key_value_heads": 2}  # max_position_embeddings=128
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
# yarn with every option away from its default, and DeepSeek's mscale pair.
YARN_OPTIONS = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 16.0,
    "beta_slow": 2.0,
    "truncate": False,
    "mscale": 0.8,
    "mscale_all_dim": 0.5,
}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def _scaling(rope: dict, max_position_embeddings: int = 128):
    """`rope_base` and `rope_scaling` as `from_hf_llama` reads them from `rope`."""
    hf = {**LLAMA, "max_position_embeddings": max_position_embeddings, "rope_parameters": rope}
    c = decoder_config(hf, "test", "float32", None)
    return c.rope_base, c.rope_scaling


def _rel_diff(ours, theirs) -> float:
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


# -- the rates, against transformers' rope initialisation functions ---------------------


RATE_CASES = (
    [{"rope_type": "linear", "factor": f} for f in (1.0, 2.0, 8.0)]
    + [{**LLAMA3, "factor": f, "rope_theta": theta} for f in (1.0, 8.0) for theta in (1e4, 5e5)]
    + [{**YARN, "factor": f, "rope_theta": theta} for f in (1.0, 4.0, 16.0) for theta in (1e4, 5e5)]
    + [
        {**YARN, "truncate": False},
        {**YARN, "beta_fast": 8.0, "beta_slow": 0.5, "original_max_position_embeddings": 512},
        {**YARN, "attention_factor": 0.75},
        YARN_OPTIONS,
        {**YARN_OPTIONS, "mscale": 0.0},  # mscale ignored when one of the pair is zero
    ]
)


@pytest.mark.hf
@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("rope", RATE_CASES, ids=lambda r: "-".join(f"{v}" for v in r.values()))
def test_rates_match_transformers(hf_lib, rope, head_dim):
    transformers, _ = hf_lib
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    base, scaling = _scaling(rope)
    config = transformers.LlamaConfig(
        **{**LLAMA, "hidden_size": 2 * head_dim, "num_attention_heads": 2},
        rope_parameters=dict(rope),
    )
    theirs, attention = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, device=None)
    ours = np.asarray(eqrope.rope_inv_freq(head_dim, base, scaling))
    assert ours.dtype == np.float32
    np.testing.assert_allclose(ours, theirs.numpy(), rtol=2e-6, atol=0)
    assert math.isclose(rope_attention_factor(scaling), attention, rel_tol=1e-12)


@pytest.mark.hf
@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("factor", [1.0, 2.0, 4.0])
@pytest.mark.parametrize("seq_len", [32, 64, 112])
def test_dynamic_rates_match_transformers_at_max_len(hf_lib, factor, head_dim, seq_len):
    """transformers' dynamic rates for a sequence of `seq_len` tokens (its
    `max_position_embeddings` is the original length) are eqrope's for `max_len=seq_len`."""
    transformers, _ = hf_lib
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "dynamic", "factor": factor, "rope_theta": 5e5}
    config = transformers.LlamaConfig(
        **{
            **LLAMA,
            "hidden_size": 2 * head_dim,
            "num_attention_heads": 2,
            "max_position_embeddings": 32,
        },
        rope_parameters=dict(rope),
    )
    theirs, attention = ROPE_INIT_FUNCTIONS["dynamic"](config, device=None, seq_len=seq_len)
    scaling = eqrope.RopeScaling("dynamic", factor, original_max_len=32, max_len=seq_len)
    ours = np.asarray(eqrope.rope_inv_freq(head_dim, 5e5, scaling))
    np.testing.assert_allclose(ours, theirs.numpy(), rtol=2e-6, atol=0)
    assert rope_attention_factor(scaling) == attention == 1.0


# -- without transformers -----------------------------------------------------------------


FACTOR_ONE = {
    "linear": eqrope.RopeScaling("linear", 1.0),
    "llama3": eqrope.RopeScaling("llama3", 1.0, original_max_len=16),
    "yarn": eqrope.RopeScaling("yarn", 1.0, original_max_len=16),
    "dynamic": eqrope.RopeScaling("dynamic", 1.0, original_max_len=96, max_len=96),
}


@pytest.mark.parametrize("kind", sorted(FACTOR_ONE))
def test_factor_one_changes_nothing(kind):
    """Same weights, `rope_scaling=None` against each scaling with factor 1 (and, for
    dynamic, max_len == original_max_len): the same logits, attention factor 1."""
    scaling = FACTOR_ONE[kind]
    plain, scaled = (
        _eqrope_model(head_bias=False),
        _eqrope_model(head_bias=False, rope_scaling=scaling),
    )
    assert rope_attention_factor(scaling) == 1.0
    rates = np.asarray(eqrope.rope_inv_freq(8, 10000.0, scaling))
    np.testing.assert_allclose(rates, np.asarray(eqrope.rope_inv_freq(8, 10000.0)), rtol=1e-7)
    ids = jnp.asarray(_ids(90, 61), jnp.int32)
    np.testing.assert_allclose(
        np.asarray(eqx.filter_jit(scaled)(ids)),
        np.asarray(eqx.filter_jit(plain)(ids)),
        rtol=1e-5,
        atol=1e-5,
    )


def test_yarn_rates_follow_the_paper_at_both_ends():
    """YaRN (Peng et al. 2023, Eq. 18): a frequency turning more than beta_fast times over
    the original length is kept; one turning fewer than beta_slow times is divided by the
    factor; in between the rate falls monotonically from one to the other."""
    for head_dim, base, old in [(64, 10000.0, 2048), (128, 5e5, 4096), (32, 10000.0, 256)]:
        scaling = eqrope.RopeScaling("yarn", 8.0, original_max_len=old, truncate=False)
        plain = np.asarray(eqrope.rope_inv_freq(head_dim, base), np.float64)
        ours = np.asarray(eqrope.rope_inv_freq(head_dim, base, scaling), np.float64)
        turns = old * plain / (2 * math.pi)
        fast, slow = turns > 32, turns < 1
        assert fast.any() and slow.any() and (~fast & ~slow).any()
        np.testing.assert_allclose(ours[fast], plain[fast], rtol=1e-6)
        np.testing.assert_allclose(ours[slow], plain[slow] / 8, rtol=1e-6)
        ratio = ours / plain
        assert np.all(np.diff(ratio) <= 1e-7) and ratio.min() >= 1 / 8 - 1e-7
    assert math.isclose(rope_attention_factor(scaling), 0.1 * math.log(8.0) + 1)


def test_dynamic_is_the_ntk_base_once():
    """dynamic = the default rates with the base enlarged once, for the sequence max_len."""
    scaling = eqrope.RopeScaling("dynamic", 4.0, original_max_len=100, max_len=250)
    ntk = 5e5 * (4.0 * 250 / 100 - 3.0) ** (64 / 62)
    assert np.array_equal(
        np.asarray(eqrope.rope_inv_freq(64, 5e5, scaling)),
        np.asarray(eqrope.rope_inv_freq(64, ntk)),
    )


def test_yarn_attention_factor_scales_scores_by_its_square():
    """apply_rope(scale=s) multiplies cosines and sines by s, so q . k by s**2."""
    rng = np.random.default_rng(0)
    q, k = (jnp.asarray(rng.standard_normal((5, 2, 16)), jnp.float32) for _ in range(2))
    positions, rates = jnp.arange(5), eqrope.rope_inv_freq(16)
    plain = jnp.einsum("shd,thd->hst", *(eqrope.apply_rope(x, positions, rates) for x in (q, k)))
    scaled = jnp.einsum(
        "shd,thd->hst", *(eqrope.apply_rope(x, positions, rates, 1.25) for x in (q, k))
    )
    np.testing.assert_allclose(np.asarray(scaled), 1.5625 * np.asarray(plain), rtol=1e-5, atol=1e-5)


EXPORTED = {
    "yarn": eqrope.RopeScaling("yarn", 4.0, original_max_len=24),
    "yarn-options": eqrope.RopeScaling(
        "yarn",
        3.0,
        original_max_len=24,
        beta_fast=16.0,
        beta_slow=2.0,
        attention_factor=1.2,
        truncate=False,
    ),
    "dynamic": eqrope.RopeScaling("dynamic", 2.0, original_max_len=96, max_len=96),
}


@pytest.mark.parametrize("name", sorted(EXPORTED))
def test_export_import_and_checkpoint_round_trips(tmp_path, name):
    model = _eqrope_model(head_bias=False, n_kv_heads=2, rope_scaling=EXPORTED[name])
    eqrope.to_hf_llama(model, tmp_path / "hf")
    back = eqrope.from_hf_llama(tmp_path / "hf")  # the decoding layout
    assert back.config == model.config
    assert all(bool((a == b).all()) for a, b in zip(jax.tree.leaves(model.with_layout(back.layout)), jax.tree.leaves(back)))
    assert eqrope.DecoderConfig.from_dict(model.config.to_dict()) == model.config
    eqrope.save(tmp_path / "ckpt", model)
    assert eqrope.load(tmp_path / "ckpt").config == model.config


def test_export_refuses_a_dynamic_scaling_transformers_would_not_follow(tmp_path):
    scaling = eqrope.RopeScaling("dynamic", 2.0, original_max_len=48, max_len=96)
    with pytest.raises(
        ValueError, match="dynamic rope scaling has original_max_len=48, max_len=96"
    ):
        eqrope.to_hf_llama(_eqrope_model(head_bias=False, rope_scaling=scaling), tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(kind="yarn", factor=-2.0, original_max_len=32), "RopeScaling.factor must be > 0"),
        (dict(kind="dynamic", factor=0.0, original_max_len=32, max_len=64), "factor must be > 0"),
        (dict(kind="yarn", factor=2.0, beta_slow=float("inf")), "beta_slow must be a finite"),
        (dict(kind="yarn", factor=2.0, beta_fast=1.0), "beta_fast > beta_slow"),
        (dict(kind="yarn", factor=2.0, attention_factor=-1.0), "attention_factor must be > 0"),
        (dict(kind="yarn", factor=2.0, truncate="no"), "truncate"),
        (dict(kind="dynamic", factor=2.0, original_max_len=64), "dynamic needs max_len"),
        (dict(kind="dynamic", factor=2.0, original_max_len=64, max_len=32), "max_len"),
        (dict(kind="linear", factor=2.0, beta_fast=8.0), "'linear' does not use beta_fast"),
        (dict(kind="llama3", factor=2.0, max_len=64), "'llama3' does not use max_len"),
        (dict(kind="ntk", factor=2.0), "kind"),
    ],
)
def test_bad_scalings_are_refused_by_name(kwargs, message):
    with pytest.raises((TypeError, ValueError), match=message):
        eqrope.RopeScaling(**kwargs)


@pytest.mark.parametrize(
    "rope, message",
    [
        ({**YARN, "beta": 1.0}, r"keys \['beta'\] that eqrope does not know for type 'yarn'"),
        ({"rope_type": "linear", "factor": 2.0, "beta_fast": 8.0}, r"keys \['beta_fast'\]"),
        ({"rope_type": "dynamic", "factor": 2.0, "mscale": 1.0}, r"keys \['mscale'\]"),
        ({**YARN, "factor": -4.0}, "factor must be > 0"),
        ({"rope_type": "dynamic"}, "without a 'factor'"),
        ({**YARN, "truncate": None}, "truncate"),
        ({**YARN, "beta_fast": "32"}, "beta_fast"),
        ({**YARN, "mscale": "1", "mscale_all_dim": 1.0}, "mscale"),
        ({**YARN, "original_max_position_embeddings": None}, "original_max_position_embeddings"),
        ({"rope_type": "dynamic", "factor": 2.0, "attention_factor": 2.0}, "only for yarn"),
        ({"rope_type": "longrope", "factor": 2.0}, "type 'longrope'"),
    ],
)
def test_bad_hf_rope_configs_are_refused_by_name(tmp_path, rope, message):
    hf = {**LLAMA, "rope_parameters": rope}
    write_hf_dir(tmp_path, hf, random_hf_tensors(hf))
    with pytest.raises(ValueError, match=message) as info:
        eqrope.from_hf_llama(tmp_path)
    assert str(tmp_path / "config.json") in str(info.value)


# -- end to end, against transformers ------------------------------------------------------


def _transformers_agree(hf_lib, tmp_path, hf: dict, *, new_tokens=20, prompt_len=64):
    """Save a random transformers Llama, load it in eqrope; logits on a `prompt_len`
    prompt within 1e-4 relative, and the same `new_tokens` greedy tokens."""
    _, torch = hf_lib
    theirs = _hf_random_model(hf_lib, hf, seed=3)
    theirs.save_pretrained(tmp_path, safe_serialization=True)
    ours = eqrope.from_hf_llama(tmp_path)
    prompt = _ids(prompt_len, hf["vocab_size"], seed=4)
    logits = np.asarray(eqx.filter_jit(ours)(jnp.asarray(prompt, jnp.int32)))
    assert _rel_diff(logits, _hf_logits(hf_lib, theirs, prompt)) < 1e-4
    if new_tokens:
        with torch.no_grad():
            expected = theirs.generate(
                torch.tensor(prompt)[None], max_new_tokens=new_tokens, do_sample=False
            )[0].numpy()
        got = np.asarray(eqrope.generate(ours, jnp.asarray(prompt, jnp.int32), new_tokens))
        assert expected.shape == (prompt_len + new_tokens,)
        assert got.tolist() == expected.tolist()
    return ours, theirs


@pytest.mark.hf
@pytest.mark.parametrize("name", ["yarn", "yarn-options", "llama3"])
def test_transformers_model_with_scaling(tmp_path, hf_lib, name):
    rope = {"yarn": YARN, "yarn-options": YARN_OPTIONS, "llama3": LLAMA3}[name]
    ours, theirs = _transformers_agree(hf_lib, tmp_path, {**LLAMA, "rope_scaling": dict(rope)})
    assert ours.config.rope_scaling.kind == rope["rope_type"]
    c = ours.config
    np.testing.assert_allclose(
        np.asarray(eqrope.rope_inv_freq(c.head_dim, c.rope_base, c.rope_scaling)),
        theirs.model.rotary_emb.inv_freq.numpy(),
        rtol=2e-6,
    )
    assert math.isclose(
        rope_attention_factor(c.rope_scaling), theirs.model.rotary_emb.attention_scaling
    )


@pytest.mark.hf
def test_transformers_dynamic_within_max_position_embeddings(tmp_path, hf_lib):
    """Up to max_position_embeddings transformers' dynamic scaling keeps the unscaled
    rates, and so does the model from_hf_llama builds (its max_len is that length):
    logits and 20 greedy tokens agree, with the cache."""
    hf = {**LLAMA, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}
    ours, _ = _transformers_agree(hf_lib, tmp_path, hf)
    s = ours.config.rope_scaling
    assert (s.kind, s.factor, s.original_max_len, s.max_len) == ("dynamic", 2.0, 128, 128)
    assert np.array_equal(
        np.asarray(eqrope.rope_inv_freq(16, ours.config.rope_base, s)),
        np.asarray(eqrope.rope_inv_freq(16, ours.config.rope_base)),
    )


@pytest.mark.hf
def test_transformers_dynamic_at_the_extended_length(tmp_path, hf_lib):
    """Trained for 32 positions, run on 64: transformers enlarges the base for the
    64-token sequence; eqrope with max_len=64 uses that base for every position, so the
    logits of a 64-token prompt agree."""
    hf = {
        **LLAMA,
        "max_position_embeddings": 32,
        "rope_scaling": {"rope_type": "dynamic", "factor": 2.0},
    }
    loaded, theirs = _transformers_agree(hf_lib, tmp_path, hf, new_tokens=0, prompt_len=32)
    scaling = dataclasses.replace(loaded.config.rope_scaling, max_len=64)
    config = dataclasses.replace(loaded.config, max_len=64, rope_scaling=scaling)
    shape = eqx.filter_eval_shape(
        lambda: eqrope.RotaryDecoder.from_config(config, key=jax.random.PRNGKey(0)).with_layout(loaded.layout)
    )
    ours = jax.tree.unflatten(jax.tree.structure(shape), jax.tree.leaves(loaded))
    prompt = _ids(64, hf["vocab_size"], seed=5)
    logits = np.asarray(eqx.filter_jit(ours)(jnp.asarray(prompt, jnp.int32)))
    assert _rel_diff(logits, _hf_logits(hf_lib, theirs, prompt)) < 1e-4


@pytest.mark.hf
@pytest.mark.parametrize("name", sorted(EXPORTED))
def test_exported_scaling_runs_in_transformers(tmp_path, hf_lib, name):
    transformers, _ = hf_lib
    model = _eqrope_model(head_bias=False, n_kv_heads=2, rope_scaling=EXPORTED[name])
    eqrope.to_hf_llama(model, tmp_path)
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    ids = _ids(90, 61)
    ours = np.asarray(eqx.filter_jit(model)(jnp.asarray(ids, jnp.int32)))
    assert _rel_diff(ours, _hf_logits(hf_lib, theirs, ids)) < 1e-4


def test_dynamic_scaling_must_cover_the_models_max_len():
    """The rates are fixed for `scaling.max_len` tokens, which must cover the model's length
    (a shorter model, as `from_hf(max_len=...)` builds, keeps the checkpoint's rates)."""
    scaling = eqrope.RopeScaling("dynamic", 2.0, original_max_len=16, max_len=64)
    eqrope.DecoderConfig(13, 16, 2, 1, 64, rope_scaling=scaling)
    eqrope.DecoderConfig(13, 16, 2, 1, 32, rope_scaling=scaling)
    with pytest.raises(ValueError, match="dynamic with max_len=64, but the model's max_len is 128"):
        eqrope.DecoderConfig(13, 16, 2, 1, 128, rope_scaling=scaling)
