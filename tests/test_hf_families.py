"""Mistral, Qwen2 and Qwen3 beside Llama: the attention options, and each family against
transformers.

- Without transformers: the sliding window's cached path against the uncached one, the
  proof that a cached step does not read the rows outside the window, and the options'
  checks.
- Against transformers (marked `hf`): for each family a tiny random model built with
  transformers' own config class, weights perturbed away from their init values (biases
  and norms included), written with `save_pretrained`, loaded with `eqrope.from_hf`:
  float32 logits on a 64-token prompt within 1e-4 relative, 40 greedy tokens identical
  to transformers' `generate`, and `eqrope.to_hf` writing back the very same tensors.
"""

import dataclasses
import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

import eqrope
import eqrope.testing
from eqrope import AttentionOptions
from _hf_llama import _hf_logits, _hf_random_model, hf_lib  # noqa: F401 (hf_lib is a fixture)


def _model(attention, *, n_kv_heads=2, seed=0, **kwargs):
    model = eqrope.RotaryDecoder(
        53, 32, 4, 3, 96, n_kv_heads=n_kv_heads, attention=attention, key=jax.random.PRNGKey(seed), **kwargs
    )
    # Biases and norm weights away from their zero/one init, so that a misplaced one shows.
    leaves, treedef = jax.tree_util.tree_flatten(model)
    rng = np.random.default_rng(seed)
    new = [
        jnp.asarray(a + 0.3 * rng.standard_normal(a.shape).astype(np.float32)) if a.ndim <= 2 else a
        for a in leaves
    ]
    return jax.tree_util.tree_unflatten(treedef, new)


WINDOWED = {
    "window-all": AttentionOptions(window=5),
    "window-some": AttentionOptions(window=7, window_blocks=(0, 2)),
    "window-qwen3": AttentionOptions(window=4, head_dim=12, qk_norm=True),
    "window-qwen2": AttentionOptions(window=9, qkv_bias=True, window_blocks=(2,)),
}


def _window_mask(seq, window):
    """The sliding-window causal mask, written out: row p sees p - window + 1 .. p."""
    p = np.arange(seq)
    return (p[None, :] <= p[:, None]) & (p[None, :] > p[:, None] - window)


@pytest.mark.parametrize("name", sorted(WINDOWED))
def test_sliding_window_cached_equals_uncached(name):
    """Prefill then steps, with a 8-row read chunk so that many chunks are skipped, give
    the logits of the whole sequence in one pass."""
    model = _model(WINDOWED[name])
    ids = jax.random.randint(jax.random.PRNGKey(1), (60,), 0, 53)
    full = model(ids)
    cache = model.init_cache(chunk=8)
    logits, cache = model.prefill(ids[:21], cache, 0)
    rows = [logits]
    step = eqx.filter_jit(lambda m, t, c, p: m.step(t, c, p))
    for p in range(21, 60):
        logits, cache = step(model, ids[p], cache, jnp.asarray(p, jnp.int32))
        rows.append(logits[None])
    np.testing.assert_allclose(jnp.concatenate(rows), full, atol=2e-5, rtol=0)


def test_sliding_window_equals_a_written_out_mask():
    """One block's attention with a window against a dense softmax under the mask above."""
    attn = eqrope.CausalSelfAttention(16, 2, 2, key=jax.random.PRNGKey(3))
    x = jax.random.normal(jax.random.PRNGKey(4), (11, 16))
    positions = jnp.arange(11, dtype=jnp.int32)
    out, _, _ = attn(x, positions, window=jnp.asarray(3, jnp.int32))
    q, k, v = (np.asarray(a, np.float64) for a in attn.project(x, positions))
    s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(8)
    s = np.where(_window_mask(11, 3)[None], s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    heads = np.einsum("hqk,khd->qhd", w, v).reshape(11, 16)
    np.testing.assert_allclose(out, heads @ np.asarray(attn.wo), atol=1e-5, rtol=0)


def test_cached_step_reads_only_the_window():
    """Rows far before the window are poisoned with NaN: a chunk that read them, even
    masked, would turn the output into NaN (0 * NaN), so finite and equal logits show
    the step never visited them. Rows outside the window but inside a visited chunk are
    left intact."""
    model = _model(AttentionOptions(window=6))
    ids = jax.random.randint(jax.random.PRNGKey(5), (90,), 0, 53)
    cache = model.init_cache(chunk=8)
    _, cache = model.prefill(ids[:89], cache, 0)
    expected, _ = model.step(ids[89], cache, 89)
    # The window of position 89 is rows 84..89; the chunks from row 80 on are needed.
    poisoned = eqx.tree_at(
        lambda c: (c.keys, c.values),
        cache,
        (cache.keys.at[:, :, :80].set(jnp.nan), cache.values.at[:, :, :80].set(jnp.nan)),
    )
    logits, _ = model.step(ids[89], poisoned, 89)
    assert np.all(np.isfinite(logits))
    np.testing.assert_array_equal(logits, expected)
    # Without the window every row is read, and the poison shows (the check can fail).
    config = dataclasses.replace(model.config, attention=AttentionOptions())
    plain = eqrope.RotaryDecoder.from_config(config, key=jax.random.PRNGKey(0))
    plain = jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(plain), jax.tree_util.tree_leaves(model)
    )
    logits, _ = plain.step(ids[89], poisoned, 89)
    assert not np.all(np.isfinite(logits))


def test_generate_with_a_window_equals_the_uncached_loop():
    model = _model(AttentionOptions(window=5, window_blocks=(1,)))
    prompt = jnp.asarray([[3, 4, 5, 6, 7, 8], [9, 10, 11, 0, 0, 0]], jnp.int32)
    lengths = jnp.asarray([6, 3], jnp.int32)
    cached = eqrope.generate(model, prompt, 30, prompt_lengths=lengths)
    uncached = eqrope.generate(eqrope.testing.Uncached(model), prompt, 30, prompt_lengths=lengths)
    np.testing.assert_array_equal(cached, uncached)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(window=0), ValueError, "AttentionOptions.window"),
        (dict(head_dim=2.5), TypeError, "head_dim"),
        (dict(qk_norm="yes"), TypeError, "qk_norm"),
        (dict(window_blocks=(1,)), ValueError, "window_blocks is set but window is None"),
        (dict(window=4, window_blocks=(2, 1)), ValueError, "increasing order"),
        (dict(window=4, window_blocks=3), TypeError, "window_blocks"),
    ],
)
def test_attention_options_are_checked(kwargs, error, message):
    with pytest.raises(error, match=message):
        AttentionOptions(**kwargs)


def test_config_checks_and_spellings():
    with pytest.raises(ValueError, match="window_blocks names block 3.*n_blocks=3"):
        eqrope.DecoderConfig(53, 32, 4, 3, 96, attention=AttentionOptions(window=4, window_blocks=(3,)))
    with pytest.raises(ValueError, match="head_dim = 7 is odd"):
        eqrope.DecoderConfig(53, 32, 4, 3, 96, attention=AttentionOptions(head_dim=7))
    # d_model need not divide by n_heads once head_dim is given.
    c = eqrope.DecoderConfig(53, 30, 4, 3, 96, attention=AttentionOptions(head_dim=8))
    assert c.head_dim == 8
    # One spelling per model: the default head width and "every block" read as None.
    c = eqrope.DecoderConfig(
        53, 32, 4, 3, 96, attention=AttentionOptions(head_dim=8, window=4, window_blocks=(0, 1, 2))
    )
    assert c.attention == AttentionOptions(window=4)
    c = eqrope.DecoderConfig(
        53, 32, 4, 3, 96, attention=AttentionOptions(head_dim=16, qk_norm=True, window=4, window_blocks=(1,))
    )
    assert eqrope.DecoderConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c


def test_checkpoint_round_trip_keeps_the_options(tmp_path):
    model = _model(AttentionOptions(head_dim=12, qk_norm=True, qkv_bias=True, window=5, window_blocks=(1, 2)))
    eqrope.save(tmp_path / "ckpt", model)
    back = eqrope.load(tmp_path / "ckpt")  # the decoding layout
    assert back.config == model.config
    ids = jnp.arange(20, dtype=jnp.int32)
    np.testing.assert_array_equal(back(ids), model.with_layout(back.layout)(ids))


# -- against transformers ------------------------------------------------------------------

SIZES = dict(
    vocab_size=101,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=3,
    num_attention_heads=4,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)
DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 10000.0,
}
# name: (family, extra config fields). Each family at least once; GQA and MQA; yarn and
# dynamic (llama3 is in tests/test_hf.py); Mistral's window shorter than the text.
FAMILIES = {
    "llama-biases-head_dim": ("llama", dict(num_key_value_heads=2, head_dim=24, attention_bias=True, mlp_bias=True)),
    "llama-attention-bias": ("llama", dict(num_key_value_heads=1, attention_bias=True)),
    "mistral-window": ("mistral", dict(num_key_value_heads=2, sliding_window=16)),
    "mistral-dynamic-mqa": ("mistral", dict(num_key_value_heads=1, sliding_window=24, rope_parameters=DYNAMIC)),
    "qwen2-yarn-mqa": ("qwen2", dict(num_key_value_heads=1, rope_parameters=YARN)),
    "qwen2-window-some": (
        "qwen2",
        dict(num_key_value_heads=2, use_sliding_window=True, sliding_window=12, max_window_layers=1),
    ),
    "qwen3-gqa": ("qwen3", dict(num_key_value_heads=2, head_dim=32)),
    "qwen3-bias-window-yarn": (
        "qwen3",
        dict(
            num_key_value_heads=2,
            head_dim=16,
            attention_bias=True,
            use_sliding_window=True,
            sliding_window=20,
            max_window_layers=0,
            rope_parameters=YARN,
        ),
    ),
}
CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}


def _theirs(hf_lib, family, extra, seed=0):
    return _hf_random_model(hf_lib, {**SIZES, **extra}, seed, classes=CLASSES[family])


def _ids(n, seed):
    return np.random.default_rng(seed).integers(0, SIZES["vocab_size"], n)


@pytest.mark.hf
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_against_transformers(tmp_path, hf_lib, name, record_property):
    _, torch = hf_lib
    family, extra = FAMILIES[name]
    theirs = _theirs(hf_lib, family, extra)
    theirs.save_pretrained(tmp_path / "hf", safe_serialization=True)
    ours = eqrope.from_hf(tmp_path / "hf")
    assert ours.config.dtype == "float32"

    ids = _ids(64, seed=1)
    expected = _hf_logits(hf_lib, theirs, ids)
    got = np.asarray(eqx.filter_jit(ours)(jnp.asarray(ids, jnp.int32)))
    rel = np.abs(got - expected).max() / np.abs(expected).max()
    record_property("max_rel_logit_diff", float(rel))
    print(f"{name}: max |logit diff| / max |logit| = {rel:.3g}")
    assert rel < 1e-4

    prompt = _ids(24, seed=2)
    with torch.no_grad():
        want = theirs.generate(torch.tensor(prompt)[None], max_new_tokens=40, do_sample=False)[0].numpy()
    tokens = np.asarray(eqrope.generate(ours, jnp.asarray(prompt, jnp.int32), 40))
    assert want.shape == (64,)
    assert tokens.tolist() == want.tolist()

    # Export writes the very tensors transformers saved, and reads back bit for bit.
    eqrope.to_hf(ours, tmp_path / "back")
    saved = safetensors.numpy.load_file(str(tmp_path / "hf" / "model.safetensors"))
    written = safetensors.numpy.load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(written) == sorted(saved)
    for n in saved:
        np.testing.assert_array_equal(written[n], saved[n], err_msg=n)
    again = eqrope.from_hf(tmp_path / "back")
    assert again.config == ours.config
    for a, b in zip(jax.tree_util.tree_leaves(again), jax.tree_util.tree_leaves(ours)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.hf
@pytest.mark.parametrize("name", ["mistral-window", "qwen2-window-some", "qwen3-bias-window-yarn"])
def test_export_loads_in_transformers(tmp_path, hf_lib, name):
    """An eqrope model of each family, exported, loads with AutoModelForCausalLM."""
    transformers, _ = hf_lib
    family, extra = FAMILIES[name]
    theirs = _theirs(hf_lib, family, extra, seed=3)
    theirs.save_pretrained(tmp_path / "hf", safe_serialization=True)
    model = eqrope.from_hf(tmp_path / "hf")
    eqrope.to_hf(model, tmp_path / "out")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(loaded).__name__ == CLASSES[family][1]
    ids = _ids(64, seed=4)
    ours = np.asarray(eqx.filter_jit(model)(jnp.asarray(ids, jnp.int32)))
    expected = _hf_logits(hf_lib, loaded, ids)
    assert np.abs(ours - expected).max() / np.abs(expected).max() < 1e-4


@pytest.mark.hf
def test_dtype_and_max_len(tmp_path, hf_lib):
    """`dtype=None` keeps a bfloat16 checkpoint bfloat16; `dtype="float32"` converts;
    `max_len` sets the model's length, bounded by max_position_embeddings."""
    transformers, torch = hf_lib
    theirs = _theirs(hf_lib, "qwen2", dict(num_key_value_heads=2)).to(torch.bfloat16)
    theirs.save_pretrained(tmp_path, safe_serialization=True)
    kept = eqrope.from_hf(tmp_path)
    assert kept.config.dtype == "bfloat16" and kept.embed.dtype == jnp.bfloat16
    assert kept.max_len == SIZES["max_position_embeddings"]
    wide = eqrope.from_hf(tmp_path, dtype="float32", max_len=100)
    assert wide.config.dtype == "float32" and wide.max_len == 100
    # bfloat16 to float32 is exact, so the converted weights are the checkpoint's.
    np.testing.assert_array_equal(np.asarray(wide.embed), np.asarray(kept.embed, np.float32))
    ids = _ids(32, seed=5)
    # (Not `theirs.float()`: its rotary buffer was rounded to bfloat16 on the way down.)
    upcast = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    expected = _hf_logits(hf_lib, upcast.eval(), ids)
    got = np.asarray(wide(jnp.asarray(ids, jnp.int32)))
    assert np.abs(got - expected).max() / np.abs(expected).max() < 1e-4
    # In bfloat16 the error is rounding, so it is set against transformers' own in bfloat16.
    low = np.asarray(kept(jnp.asarray(ids, jnp.int32)).astype(jnp.float32), np.float64)
    their_low = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    their_error = np.abs(_hf_logits(hf_lib, their_low.eval(), ids) - expected).mean()
    our_error = np.abs(low - expected).mean()
    print(f"bfloat16 mean |logit error|: eqrope {our_error:.3g}, transformers {their_error:.3g}")
    assert our_error < 1.5 * their_error
    with pytest.raises(ValueError, match="max_len=300 is more than the checkpoint's max_position_embeddings=256"):
        eqrope.from_hf(tmp_path, max_len=300)
