"""An independent reference: the decoder's forward pass in plain NumPy (float64).

Written from the equations, not from eqrope's code. Only the weights are read out of a
randomly initialised `eqrope.RotaryDecoder`, using its documented layouts: `x @ W`
(shape `(in, out)`); a fused `wqkv` with columns `[q heads | k heads | v heads]`; a fused
SwiGLU `w_gate_up = [gate | up]`; blocks stacked along a leading `blocks` axis.

- RMSNorm: `x / sqrt(mean(x^2) + eps) * w` (Zhang & Sennrich 2019, Eq. 4, eps in the root).
- LayerNorm: `(x - mean) / sqrt(var + eps) * w + b`.
- RoPE (RoFormer Eq. 15): pairs `(x[2i], x[2i+1])` rotated by `m * base^(-2i/head_dim)`.
- Attention: softmax(q k^T / sqrt(head_dim)) with a causal mask; GQA repeats each kv head
  for `n_heads // n_kv_heads` consecutive query heads.
- SwiGLU (Shazeer 2020, Eq. 6): `(silu(x Wg) * (x Wu)) Wd`; GELU MLP: exact (erf) GELU.
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqrope


VOCAB, D_MODEL, HEADS, BLOCKS, MAX_LEN, D_FF = 31, 32, 4, 2, 16, 48

CONFIGS = {
    "mha": dict(),
    "gqa": dict(n_kv_heads=2),
    "mqa": dict(n_kv_heads=1),
    "base500_tied": dict(n_kv_heads=2, rope_base=500.0, tie_embeddings=True, head_bias=False),
    "chapter": dict(norm="layer", mlp="gelu", bias=True),
    "chapter_learned": dict(norm="layer", mlp="gelu", bias=True, positions="learned"),
    "learned": dict(positions="learned"),
}


# -- the reference ---------------------------------------------------------------------------


def f64(a):
    return None if a is None else np.asarray(a, dtype=np.float64)


def rms_norm(x, weight, eps):
    return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps) * weight


def layer_norm(x, weight, bias, eps):
    mean = np.mean(x, axis=-1, keepdims=True)
    var = np.mean((x - mean) ** 2, axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * weight + bias


def norm(x, weight, bias, config):
    if config.norm == "rms":
        assert bias is None
        return rms_norm(x, weight, config.norm_eps)
    return layer_norm(x, weight, bias, config.norm_eps)


def rope(x, positions, base):
    """RoFormer Eq. (15) on `x` of shape (seq, heads, head_dim), one pair at a time."""
    head_dim = x.shape[-1]
    out = np.empty_like(x)
    for i in range(head_dim // 2):
        angle = positions.astype(np.float64) * base ** (-2.0 * i / head_dim)
        c, s = np.cos(angle)[:, None], np.sin(angle)[:, None]
        even, odd = x[..., 2 * i], x[..., 2 * i + 1]
        out[..., 2 * i] = even * c - odd * s
        out[..., 2 * i + 1] = even * s + odd * c
    return out


def softmax(s):
    s = s - np.max(s, axis=-1, keepdims=True)
    e = np.exp(s)
    return e / np.sum(e, axis=-1, keepdims=True)


def repeat_kv(kv, group):
    """Query head h reads kv head h // group (each kv head serves consecutive heads)."""
    return np.repeat(kv, group, axis=1)


def attention(x, w, config, rope_fn=rope, expand_kv=repeat_kv):
    seq = x.shape[0]
    heads, kv_heads = config.n_heads, config.n_kv_heads
    head_dim = config.d_model // heads
    qkv = x @ w["wqkv"]
    if w["bqkv"] is not None:
        qkv = qkv + w["bqkv"]
    q = qkv[:, : heads * head_dim].reshape(seq, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].reshape(seq, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].reshape(seq, kv_heads, head_dim)
    assert v.shape == k.shape
    if config.positions == "rope":
        positions = np.arange(seq)
        q = rope_fn(q, positions, config.rope_base)
        k = rope_fn(k, positions, config.rope_base)
    k = expand_kv(k, heads // kv_heads)
    v = expand_kv(v, heads // kv_heads)
    scores = np.einsum("shd,thd->hst", q, k) / math.sqrt(head_dim)
    future = np.arange(seq)[None, :] > np.arange(seq)[:, None]
    scores = np.where(future[None], -np.inf, scores)
    out = np.einsum("hst,thd->shd", softmax(scores), v).reshape(seq, heads * head_dim)
    out = out @ w["wo"]
    if w["bo"] is not None:
        out = out + w["bo"]
    return out


def silu(x):
    return x / (1.0 + np.exp(-x))


def gelu_exact(x):
    erf = np.vectorize(math.erf)
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


def feed_forward(x, w, config):
    if config.mlp == "swiglu":
        gate_up = x @ w["w_gate_up"]
        if w["b_gate_up"] is not None:
            gate_up = gate_up + w["b_gate_up"]
        gate, up = gate_up[:, : config.d_ff], gate_up[:, config.d_ff :]
        out = (silu(gate) * up) @ w["w_down"]
        return out if w["b_down"] is None else out + w["b_down"]
    h = x @ w["w_in"]
    if w["b_in"] is not None:
        h = h + w["b_in"]
    out = gelu_exact(h) @ w["w_out"]
    return out if w["b_out"] is None else out + w["b_out"]


def block_weights(model, b):
    """Block `b`'s arrays as float64 NumPy, taken from the stacked `model.blocks`."""
    blocks = model.blocks
    take = lambda a: None if a is None else f64(a[b])  # noqa: E731
    mlp = blocks.mlp
    w = dict(
        attn_norm_w=take(blocks.attn_norm.weight),
        attn_norm_b=take(blocks.attn_norm.bias),
        mlp_norm_w=take(blocks.mlp_norm.weight),
        mlp_norm_b=take(blocks.mlp_norm.bias),
        wqkv=take(blocks.attn.wqkv),
        bqkv=take(blocks.attn.bqkv),
        wo=take(blocks.attn.wo),
        bo=take(blocks.attn.bo),
    )
    if model.config.mlp == "swiglu":
        w.update(
            w_gate_up=take(mlp.w_gate_up),
            b_gate_up=take(mlp.b_gate_up),
            w_down=take(mlp.w_down),
            b_down=take(mlp.b_down),
        )
    else:
        w.update(
            w_in=take(mlp.w_in), b_in=take(mlp.b_in), w_out=take(mlp.w_out), b_out=take(mlp.b_out)
        )
    return w


def reference_forward(model, ids, rope_fn=rope, expand_kv=repeat_kv):
    config = model.config
    ids = np.asarray(ids)
    x = f64(model.embed)[ids]
    if config.positions == "learned":
        x = x + f64(model.pos_embed)[: len(ids)]
    for b in range(config.n_blocks):
        w = block_weights(model, b)
        h = norm(x, w["attn_norm_w"], w["attn_norm_b"], config)
        x = x + attention(h, w, config, rope_fn, expand_kv)
        x = x + feed_forward(norm(x, w["mlp_norm_w"], w["mlp_norm_b"], config), w, config)
    x = norm(x, f64(model.final_norm.weight), f64(model.final_norm.bias), config)
    head = f64(model.embed).T if model.head is None else f64(model.head)
    logits = x @ head
    if model.head_bias is not None:
        logits = logits + f64(model.head_bias)
    return logits


# -- the models ------------------------------------------------------------------------------


def randomise_constants(model, seed):
    """Replace the arrays that start as ones or zeros (norm weights, every bias, the head
    bias) with random values, so that the comparison sees them."""
    rng = np.random.default_rng(seed)

    def where(m):
        candidates = [
            m.head_bias,
            m.final_norm.weight,
            m.final_norm.bias,
            m.blocks.attn_norm.weight,
            m.blocks.attn_norm.bias,
            m.blocks.mlp_norm.weight,
            m.blocks.mlp_norm.bias,
            m.blocks.attn.bqkv,
            m.blocks.attn.bo,
        ]
        mlp = m.blocks.mlp
        if isinstance(mlp, eqrope.SwiGLU):
            candidates += [mlp.b_gate_up, mlp.b_down]
        else:
            candidates += [mlp.b_in, mlp.b_out]
        return [c for c in candidates if c is not None]

    old = where(model)
    centre = lambda a: 1.0 if np.all(np.asarray(a) == 1) else 0.0  # noqa: E731
    new = [jnp.asarray(centre(a) + 0.3 * rng.normal(size=a.shape), a.dtype) for a in old]
    return eqx.tree_at(where, model, new)


_MODELS = {}


def make_model(name):
    """`eqrope.RotaryDecoder` with its own random init, then `randomise_constants`."""
    if name not in _MODELS:
        model = eqrope.RotaryDecoder(
            VOCAB,
            D_MODEL,
            HEADS,
            BLOCKS,
            MAX_LEN,
            d_ff=D_FF,
            key=jax.random.PRNGKey(7),
            **CONFIGS[name],
        )
        _MODELS[name] = randomise_constants(model, seed=list(CONFIGS).index(name))
    return _MODELS[name]


@eqx.filter_jit
def forward(model, ids):
    return model(ids)


# -- the tests -------------------------------------------------------------------------------


def test_head_bias_is_random_and_weights_have_the_documented_layout():
    model = make_model("gqa")
    assert model.head_bias is not None and float(jnp.std(model.head_bias)) > 0.1
    head_dim = D_MODEL // HEADS
    assert model.blocks.attn.wqkv.shape == (BLOCKS, D_MODEL, (HEADS + 2 * 2) * head_dim)
    assert model.blocks.attn.wo.shape == (BLOCKS, HEADS * head_dim, D_MODEL)
    assert model.blocks.mlp.w_gate_up.shape == (BLOCKS, D_MODEL, 2 * D_FF)
    assert model.blocks.mlp.w_down.shape == (BLOCKS, D_FF, D_MODEL)
    assert model.head.shape == (D_MODEL, VOCAB)


def check_against_reference(model, ids, label):
    got = np.asarray(forward(model, jnp.asarray(ids, jnp.int32)), np.float64)
    want = reference_forward(model, ids)
    assert got.shape == (len(ids), VOCAB)
    assert np.max(np.abs(want)) > 0.5  # the comparison is not between two near-zeros
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5, err_msg=label)


@pytest.mark.usefixtures("precision")
@pytest.mark.parametrize("name", ["mha", "gqa", "mqa"])
def test_core_configs_match_numpy_reference(name):
    ids = np.random.default_rng(123).integers(0, VOCAB, size=MAX_LEN)
    check_against_reference(make_model(name), ids, name)


@pytest.mark.parametrize("name", ["base500_tied", "chapter", "chapter_learned", "learned"])
def test_variants_match_numpy_reference(name):
    ids = np.random.default_rng(321).integers(0, VOCAB, size=MAX_LEN)
    check_against_reference(make_model(name), ids, name)


@pytest.mark.parametrize("seq", [1, 5])
def test_short_sequences_match_numpy_reference(seq):
    ids = np.random.default_rng(seq).integers(0, VOCAB, size=seq)
    check_against_reference(make_model("gqa"), ids, f"seq={seq}")


def rope_rotate_half(x, positions, base):
    """The GPT-NeoX pairing (i, i + head_dim/2), which eqrope must NOT use."""
    half = x.shape[-1] // 2
    angle = positions.astype(np.float64)[:, None] * base ** (-2.0 * np.arange(half) / x.shape[-1])
    c, s = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1)


def test_reference_detects_a_wrong_pairing():
    """The comparison is sharp enough to tell RoFormer's interleaved pairs from rotate-half."""
    model = make_model("mha")
    ids = np.arange(MAX_LEN) % VOCAB
    got = np.asarray(forward(model, jnp.asarray(ids, jnp.int32)), np.float64)
    np.testing.assert_allclose(got, reference_forward(model, ids), rtol=0, atol=1e-5)
    wrong = reference_forward(model, ids, rope_fn=rope_rotate_half)
    assert np.max(np.abs(got - wrong)) > 1e-3


def test_reference_detects_a_wrong_kv_head_mapping():
    """...and to tell `h // group` (repeat) from `h % n_kv_heads` (tile) in GQA."""
    model = make_model("gqa")
    ids = np.arange(MAX_LEN) % VOCAB
    got = np.asarray(forward(model, jnp.asarray(ids, jnp.int32)), np.float64)
    tile = lambda kv, group: np.tile(kv, (1, group, 1))  # noqa: E731
    wrong = reference_forward(model, ids, expand_kv=tile)
    assert np.max(np.abs(got - wrong)) > 1e-3


def test_float64_model_matches_reference_under_x64():
    with jax.enable_x64(True):
        # The skeleton of a float64 model, filled with the float32 model's random weights.
        skeleton = eqx.filter_eval_shape(
            lambda: eqrope.RotaryDecoder(
                VOCAB,
                D_MODEL,
                HEADS,
                BLOCKS,
                MAX_LEN,
                d_ff=D_FF,
                dtype="float64",
                key=jax.random.PRNGKey(0),
                **CONFIGS["gqa"],
            )
        )
        leaves = [jnp.asarray(a, jnp.float64) for a in jax.tree.leaves(make_model("gqa"))]
        model = jax.tree.unflatten(jax.tree.structure(skeleton), leaves)
        assert model.embed.dtype == jnp.float64 and model.config.dtype == "float64"
        ids = np.random.default_rng(5).integers(0, VOCAB, size=MAX_LEN)
        got = np.asarray(forward(model, jnp.asarray(ids, jnp.int32)))
        assert got.dtype == np.float64
        # RoPE angles are float32 by design, so float64 weights do not buy 1e-12 here.
        np.testing.assert_allclose(got, reference_forward(model, ids), rtol=0, atol=1e-5)
