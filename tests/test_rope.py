"""Rotary position embeddings (RoFormer Eq. 15), checked against hand computations."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqrope


pytestmark = pytest.mark.usefixtures("precision")


def rotate(x, positions, base=10000.0, scaling=None):
    """`eqrope.apply_rope` on `x` of shape (seq, heads, head_dim)."""
    x = jnp.asarray(x)
    inv_freq = eqrope.rope_inv_freq(x.shape[-1], base, scaling)
    return eqrope.apply_rope(x, jnp.asarray(positions, jnp.int32), inv_freq)


def test_inv_freq_is_base_to_the_minus_2i_over_d():
    for head_dim, base in [(4, 10000.0), (32, 10000.0), (8, 500.0)]:
        got = np.asarray(eqrope.rope_inv_freq(head_dim, base))
        want = [base ** (-2 * i / head_dim) for i in range(head_dim // 2)]
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_position_zero_is_the_identity():
    x = np.random.default_rng(0).normal(size=(3, 2, 16)).astype(np.float32)
    out = rotate(x, [0, 0, 0])
    np.testing.assert_array_equal(np.asarray(out), x)


def test_norms_are_preserved():
    x = np.random.default_rng(1).normal(size=(64, 3, 32)).astype(np.float32)
    positions = np.concatenate([np.arange(32), 1000 + 37 * np.arange(32)])
    out = np.asarray(rotate(x, positions))
    np.testing.assert_allclose(np.linalg.norm(out, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
    # And each pair (x[2i], x[2i+1]) keeps its own length: a rotation within the pair.
    pair = lambda a: np.hypot(a[..., 0::2], a[..., 1::2])  # noqa: E731
    np.testing.assert_allclose(pair(out), pair(x), rtol=1e-5, atol=1e-6)


def relative_position_spread(head_dim=32, n_positions=64, seed=0):
    """One random query and key, each rotated to every position; for all pairs n <= m,
    the spread (max - min) of q_m . k_n within each distance m - n.

    Returns `(worst spread, number of pairs, per-distance values)`.
    """
    rng = np.random.default_rng(seed)
    q, k = rng.normal(size=(2, head_dim)).astype(np.float32)
    positions = np.arange(n_positions)
    qs = np.asarray(rotate(np.broadcast_to(q, (n_positions, 1, head_dim)), positions))[:, 0]
    ks = np.asarray(rotate(np.broadcast_to(k, (n_positions, 1, head_dim)), positions))[:, 0]
    dots = qs.astype(np.float64) @ ks.astype(np.float64).T  # dots[m, n] = q_m . k_n
    m, n = np.nonzero(np.arange(n_positions)[:, None] >= np.arange(n_positions)[None, :])
    distance = m - n
    spreads, first = [], []
    for d in range(n_positions):
        values = dots[m[distance == d], n[distance == d]]
        spreads.append(values.max() - values.min())
        first.append(values[0])
    return max(spreads), len(m), np.array(first)


def test_relative_position_property_over_all_2080_pairs(capsys):
    spread, n_pairs, by_distance = relative_position_spread()
    assert n_pairs == 2080
    with capsys.disabled():
        print(f"\nRoPE relative-position spread over 2080 pairs: {spread:.2e} (chapter: 4.1e-06)")
    assert spread < 1e-5
    # The common value at distance d is the query rotated by d against the unrotated key,
    # computed here by hand. Per pair, R(m t) q . R(n t) k = q . R(-d t) k
    #   = (q0 k0 + q1 k1) cos(d t) + (q0 k1 - q1 k0) sin(d t),
    # which also pins the direction of the rotation.
    rng = np.random.default_rng(0)
    q, k = rng.normal(size=(2, 32)).astype(np.float32).astype(np.float64)
    theta = 10000.0 ** (-2 * np.arange(16) / 32)
    for d in (0, 1, 7, 63):
        c, s = np.cos(d * theta), np.sin(d * theta)
        want = np.sum(
            (q[0::2] * k[0::2] + q[1::2] * k[1::2]) * c
            + (q[0::2] * k[1::2] - q[1::2] * k[0::2]) * s
        )
        assert abs(by_distance[d] - want) < 1e-4


def test_four_dim_vector_against_hand_computation():
    # theta_0 = 10000^(0/4) = 1, theta_1 = 10000^(-2/4) = 0.01
    x = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    positions = [0, 1, 3, 250]
    out = np.asarray(rotate(np.broadcast_to(x, (4, 1, 4)), positions))[:, 0]
    for row, m in enumerate(positions):
        a, b = m * 1.0, m * 0.01
        want = [
            1.0 * math.cos(a) - 2.0 * math.sin(a),
            1.0 * math.sin(a) + 2.0 * math.cos(a),
            3.0 * math.cos(b) - 4.0 * math.sin(b),
            3.0 * math.sin(b) + 4.0 * math.cos(b),
        ]
        # float32 angles: m * theta carries a relative error of ~6e-8
        np.testing.assert_allclose(out[row], want, rtol=0, atol=2e-5 * max(1, m / 10))


def test_four_dim_vector_position_3_exact_values():
    out = np.asarray(rotate(np.array([[[1.0, 2.0, 3.0, 4.0]]], np.float32), [3]))[0, 0]
    want = [
        math.cos(3) - 2 * math.sin(3),
        math.sin(3) + 2 * math.cos(3),
        3 * math.cos(0.03) - 4 * math.sin(0.03),
        3 * math.sin(0.03) + 4 * math.cos(0.03),
    ]
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-6)
    # Rotate-half (pairs (0, 2), (1, 3)) would give a different vector:
    rotate_half = [
        1 * math.cos(3) - 3 * math.sin(3),
        2 * math.cos(0.03) - 4 * math.sin(0.03),
        1 * math.sin(3) + 3 * math.cos(3),
        2 * math.sin(0.03) + 4 * math.cos(0.03),
    ]
    assert np.max(np.abs(out - np.array(rotate_half))) > 0.5


def test_custom_base_changes_only_the_rates():
    x = np.array([[[0.5, -1.0, 2.0, 0.25]]], np.float32)
    out = np.asarray(rotate(x, [5], base=100.0))[0, 0]
    a, b = 5.0, 5.0 * 100.0**-0.5
    want = [
        0.5 * math.cos(a) + 1.0 * math.sin(a),
        0.5 * math.sin(a) - 1.0 * math.cos(a),
        2.0 * math.cos(b) - 0.25 * math.sin(b),
        2.0 * math.sin(b) + 0.25 * math.cos(b),
    ]
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-6)


def test_bfloat16_input_uses_float32_angles():
    # Position 1001 is not a bfloat16 number (it would round to 1000 or 1002): angles
    # computed in bfloat16 would be off by up to a radian at theta_0 = 1.
    x32 = np.random.default_rng(2).normal(size=(2, 1, 8)).astype(np.float32)
    x16 = jnp.asarray(x32, jnp.bfloat16)
    positions = [1001, 40_000 + 3]
    out = rotate(x16, positions)
    assert out.dtype == jnp.bfloat16
    exact = np.asarray(rotate(np.asarray(x16.astype(jnp.float32)), positions))
    # Only the final cast to bfloat16 differs (relative 2^-8 of the largest element).
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), exact, rtol=0, atol=2e-2)
    theta = 10000.0 ** (-2 * np.arange(4) / 8)
    xs = np.asarray(x16.astype(jnp.float32), np.float64)[:, 0]
    for row, m in enumerate(positions):
        c, s = np.cos(m * theta), np.sin(m * theta)
        want = np.stack(
            [xs[row, 0::2] * c - xs[row, 1::2] * s, xs[row, 0::2] * s + xs[row, 1::2] * c], axis=-1
        ).reshape(-1)
        np.testing.assert_allclose(np.asarray(out.astype(jnp.float32))[row, 0], want, atol=3e-2)
    # And the program computes cos and sin on float32 values.
    inv_freq = eqrope.rope_inv_freq(8)
    jaxpr = jax.make_jaxpr(eqrope.apply_rope)(x16, jnp.asarray(positions, jnp.int32), inv_freq)
    trig = [e for e in jaxpr.jaxpr.eqns if e.primitive.name in ("cos", "sin")]
    assert trig and all(e.invars[0].aval.dtype == jnp.float32 for e in trig)


def test_values_are_never_rotated():
    attn = eqrope.CausalSelfAttention(16, 4, 2, key=jax.random.PRNGKey(0))
    x = jnp.asarray(np.random.default_rng(3).normal(size=(5, 16)), jnp.float32)
    near = jnp.arange(5, dtype=jnp.int32)
    far = near + 100
    project = eqx.filter_jit(lambda a, x, p: a.project(x, p))
    q0, k0, v0 = project(attn, x, near)
    q1, k1, v1 = project(attn, x, far)
    np.testing.assert_array_equal(np.asarray(v0), np.asarray(v1))
    assert float(jnp.max(jnp.abs(k0 - k1))) > 1e-2
    assert float(jnp.max(jnp.abs(q0 - q1))) > 1e-2
    # The values are exactly the value columns of x @ wqkv, unrotated.
    raw = np.asarray(x) @ np.asarray(attn.wqkv)
    np.testing.assert_allclose(np.asarray(v0).reshape(5, 8), raw[:, 16 + 8 :], atol=1e-5)
    # and the keys are the key columns rotated by their position, queries likewise.
    inv_freq = eqrope.rope_inv_freq(4)
    keys = jnp.asarray(raw[:, 16 : 16 + 8].reshape(5, 2, 4))
    np.testing.assert_allclose(
        np.asarray(k1), np.asarray(eqrope.apply_rope(keys, far, inv_freq)), atol=1e-5
    )
    # The layer's output depends on positions only through differences (shift invariance).
    call = eqx.filter_jit(lambda a, x, p: a(x, p))
    out_near, _, _ = call(attn, x, near)
    out_far, _, _ = call(attn, x, far)
    np.testing.assert_allclose(np.asarray(out_near), np.asarray(out_far), atol=1e-4)


def test_linear_scaling_divides_every_rate():
    scaling = eqrope.RopeScaling("linear", 4.0)
    got = np.asarray(eqrope.rope_inv_freq(16, 10000.0, scaling))
    want = [10000.0 ** (-2 * i / 16) / 4.0 for i in range(8)]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def llama3_by_hand(head_dim, base, factor, low, high, old_len):
    """Meta's Llama 3.1 rule, one frequency at a time, in float64."""
    out, regimes = [], set()
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    for i in range(head_dim // 2):
        freq = base ** (-2 * i / head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            out.append(freq)
            regimes.add("kept")
        elif wavelen > low_freq_wavelen:
            out.append(freq / factor)
            regimes.add("divided")
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
            regimes.add("smoothed")
    return np.array(out), regimes


@pytest.mark.parametrize(
    "head_dim, base, factor, low, high, old_len",
    [(128, 500000.0, 8.0, 1.0, 4.0, 8192), (64, 10000.0, 4.0, 2.0, 8.0, 256)],
)
def test_llama3_scaling_matches_the_hand_formula(head_dim, base, factor, low, high, old_len):
    scaling = eqrope.RopeScaling(
        "llama3", factor, low_freq_factor=low, high_freq_factor=high, original_max_len=old_len
    )
    got = np.asarray(eqrope.rope_inv_freq(head_dim, base, scaling))
    want, regimes = llama3_by_hand(head_dim, base, factor, low, high, old_len)
    assert regimes == {"kept", "divided", "smoothed"}  # the test sees all three branches
    np.testing.assert_allclose(got, want, rtol=2e-6)


def test_scaled_rates_reach_the_model():
    scaling = eqrope.RopeScaling("linear", 2.0)
    skeleton = eqx.filter_eval_shape(
        lambda: eqrope.RotaryDecoder(
            11, 8, 2, 1, 8, rope_scaling=scaling, key=jax.random.PRNGKey(0)
        )
    )
    assert skeleton.blocks.attn.rope_scaling == scaling
    attn = eqrope.CausalSelfAttention(8, 2, 2, rope_scaling=scaling, key=jax.random.PRNGKey(0))
    x = jnp.asarray(np.random.default_rng(4).normal(size=(3, 8)), jnp.float32)
    positions = jnp.arange(3, dtype=jnp.int32)
    _, k, _ = attn.project(x, positions)
    raw = (np.asarray(x) @ np.asarray(attn.wqkv))[:, 8:16].reshape(3, 2, 4)
    # linear scaling by 2 at position t is the unscaled rotation at position t / 2
    theta = np.array([1.0, 0.01]) / 2.0
    for t in range(3):
        c, s = np.cos(t * theta), np.sin(t * theta)
        want = np.stack(
            [raw[t, :, 0::2] * c - raw[t, :, 1::2] * s, raw[t, :, 0::2] * s + raw[t, :, 1::2] * c],
            axis=-1,
        ).reshape(2, 4)
        np.testing.assert_allclose(np.asarray(k)[t], want, atol=1e-5)


def test_any_integer_dtype_for_positions(precision):
    x = jnp.asarray(np.random.default_rng(5).normal(size=(4, 2, 8)), jnp.float32)
    inv_freq = eqrope.rope_inv_freq(8)
    want = eqrope.apply_rope(x, jnp.asarray([0, 3, 9, 300], jnp.int32), inv_freq)
    for dtype in (jnp.int16,) + ((jnp.int64,) if precision == "x64" else ()):
        got = eqrope.apply_rope(x, jnp.asarray([0, 3, 9, 300], dtype), inv_freq)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
