"""A float64 model's attention computes in float64 (issue 43, B4): the scores, the softmax
and the weighted sum of the values, on every path (no cache, a read-only past read in
chunks, a per-block cache written first, short or chunked). They used to run in float32,
rounding the output to float32 and flushing values below ~1e-38 to 0.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqrope


SEQ, D, HEADS, KV_HEADS = 6, 32, 4, 2
HD = D // HEADS
# float64 rounding of a few sums of `D` terms; float32 would be ~1e-7.
RTOL = 1e-12


def _reference(x, wqkv, wo):
    """Causal grouped-query attention without rotation, in float64 NumPy."""
    qkv = x @ wqkv
    q = qkv[:, : HEADS * HD].reshape(SEQ, HEADS, HD).transpose(1, 0, 2)
    k = qkv[:, HEADS * HD : (HEADS + KV_HEADS) * HD].reshape(SEQ, KV_HEADS, HD).transpose(1, 0, 2)
    v = qkv[:, (HEADS + KV_HEADS) * HD :].reshape(SEQ, KV_HEADS, HD).transpose(1, 0, 2)
    group = HEADS // KV_HEADS
    k, v = np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)
    s = q @ k.transpose(0, 2, 1) / np.sqrt(HD)
    s = np.where(np.tril(np.ones((SEQ, SEQ), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return (p @ v).transpose(1, 0, 2).reshape(SEQ, D) @ wo


def _paths(att, x):
    """The attention output of `x` at positions 0.. through each path of the layer."""
    positions = jnp.arange(SEQ, dtype=jnp.int32)
    out = {"no cache": att(x, positions)[0]}
    # A read-only past of the first rows (in chunks of 2 of 8 rows), then the rest.
    split = 4
    _, k, v = att(x[:split], positions[:split])
    rows = lambda a: jnp.zeros((1, KV_HEADS, 8, HD), a.dtype).at[0, :, :split].set(a)  # noqa: E731
    past = eqrope.KVCache(keys=rows(k), values=rows(v), chunk=2).block(jnp.asarray(0, jnp.int32))
    rest = att(x[split:], positions[split:], past)[0]
    out["past, chunked"] = jnp.concatenate([out["no cache"][:split], rest])
    # A per-block cache written first: one pass (short) or chunk by chunk.
    for name, chunk in (("decode, short", 8), ("decode, chunked", 2)):
        empty = jnp.zeros((KV_HEADS, 8, HD), x.dtype)
        cache = eqrope.KVCache(keys=(empty,), values=(empty,), chunk=chunk)
        out[name] = att.decode(x, positions, cache, 0)[0]
    return out


@pytest.mark.parametrize("scale", [1.0, 1e-200, 1e30])
def test_float64_attention_matches_float64_numpy(scale):
    """Inputs of size 1, 1e-200 (values far below float32's range) and 1e30 (scores far
    above it)."""
    with jax.enable_x64(True):
        att = eqrope.CausalSelfAttention(
            D, HEADS, KV_HEADS, rope=False, dtype=jnp.float64, key=jax.random.PRNGKey(0)
        )
        x = np.random.default_rng(0).standard_normal((SEQ, D)) * scale
        expected = _reference(x, np.asarray(att.wqkv), np.asarray(att.wo))
        for name, got in _paths(att, jnp.asarray(x)).items():
            assert got.dtype == jnp.float64, name
            got = np.asarray(got)
            assert not (got == 0).all(), f"{name}: flushed to 0"
            err = np.abs(got - expected).max() / np.abs(expected).max()
            assert err <= RTOL, f"{name}: rel. error {err:.2g} (tolerance {RTOL:g})"


def test_float64_model_steps_equal_its_forward():
    """A whole float64 decoder (rotary positions included): its cached prefill and steps
    equal its uncached forward to float64 rounding (they used to differ by float32's)."""
    with jax.enable_x64(True):
        model = eqrope.RotaryDecoder(
            23, 32, 4, 2, 16, n_kv_heads=2, dtype=jnp.float64, key=jax.random.PRNGKey(0)
        )
        ids = jax.random.randint(jax.random.PRNGKey(1), (12,), 0, 23, dtype=jnp.int32)
        full = np.asarray(model(ids))
        cache = model.init_cache(chunk=4)
        logits, cache = model.prefill(ids[:6], cache)
        got = [np.asarray(logits)]
        for pos in range(6, 12):
            step, cache = model.step(ids[pos], cache, pos)
            got.append(np.asarray(step)[None])
    got = np.concatenate(got)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, full, rtol=0, atol=RTOL * np.abs(full).max())
