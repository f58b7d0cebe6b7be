"""Decode attention reads the cache in chunks and skips those past the position."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqrope
from eqrope.model import _kernel


pytestmark = pytest.mark.usefixtures("precision")

MAX_LEN, CHUNK = 48, 16


@pytest.fixture(scope="module")
def model():
    return eqrope.RotaryDecoder(23, 32, 4, 2, MAX_LEN, n_kv_heads=2, key=jax.random.PRNGKey(0))


@pytest.fixture(scope="module")
def ids():
    return jax.random.randint(jax.random.PRNGKey(1), (MAX_LEN,), 0, 23, dtype=jnp.int32)


def test_step_equals_full_forward_at_chunk_boundaries(model, ids):
    full = model(ids)
    step = eqx.filter_jit(lambda m, t, c, p: m.step(t, c, p))
    cache = model.init_cache(chunk=CHUNK)
    checked = {0, CHUNK - 1, CHUNK, 2 * CHUNK, MAX_LEN - 1}
    seen = set()
    for pos in range(MAX_LEN):
        logits, cache = step(model, ids[pos], cache, jnp.asarray(pos, jnp.int32))
        if pos in checked:
            np.testing.assert_allclose(logits, full[pos], atol=1e-5, rtol=0)
            seen.add(pos)
    assert seen == checked


def test_overlapping_last_chunk(model, ids):
    """max_len 48 in chunks of 20: the third chunk starts at 28, overlapping rows 28..39."""
    full = model(ids)
    step = eqx.filter_jit(lambda m, t, c, p: m.step(t, c, p))
    cache = model.init_cache(chunk=20)
    for pos in range(MAX_LEN):
        logits, cache = step(model, ids[pos], cache, jnp.asarray(pos, jnp.int32))
    np.testing.assert_allclose(logits, full[-1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("pos", [0, CHUNK - 1, CHUNK, 2 * CHUNK + 3])
def test_prefill_at_offset_equals_full_forward(model, ids, pos):
    full = model(ids)
    empty = model.init_cache(chunk=CHUNK)
    _, cache = model.prefill(ids[:pos], empty) if pos else (None, empty)
    logits, _ = model.prefill(ids[pos : pos + 8], cache, pos)
    np.testing.assert_allclose(logits, full[pos : pos + 8], atol=1e-5, rtol=0)


def test_skipped_chunks_do_not_matter(model, ids):
    """Rows past the position hold garbage; the result must not see them."""
    _, cache = model.prefill(ids[:20], model.init_cache(chunk=CHUNK))
    junk = eqrope.KVCache(
        keys=cache.keys.at[:, :, 21:].set(1e3),
        values=cache.values.at[:, :, 21:].set(-1e3),
        chunk=CHUNK,
    )
    a, _ = model.step(ids[20], cache, 20)
    b, _ = model.step(ids[20], junk, 20)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_batched_steps_with_an_unbatched_bound(model, ids):
    cache = model.init_cache(chunk=CHUNK)
    _, cache = model.prefill(ids[:40], cache)
    batch = jax.tree.map(lambda x: jnp.stack([x, x, x]), cache)
    pos = jnp.array([3, 17, 39], jnp.int32)
    tokens = ids[pos]
    step = lambda t, c, p: model.step(t, c, p, kv_bound=jnp.max(pos))
    logits, _ = jax.vmap(step)(tokens, batch, pos)
    full = model(ids)
    np.testing.assert_allclose(logits, full[pos], atol=1e-5, rtol=0)


def test_merge_cache_matches_dense_softmax():
    """The streaming softmax against a direct softmax over the visible rows."""
    keys = jax.random.split(jax.random.PRNGKey(2), 3)
    q = jax.random.normal(keys[0], (2, 2, 3, 8), jnp.float32)
    k = jax.random.normal(keys[1], (1, 2, 40, 8), jnp.float32)
    v = jax.random.normal(keys[2], (1, 2, 40, 8), jnp.float32)
    past = eqrope.KVCache(keys=k, values=v, chunk=8).block(jnp.asarray(0, jnp.int32))
    positions = jnp.asarray([29, 30], jnp.int32)  # two queries; both see rows 0..28 of the cache
    state = _kernel.empty_state(2, 3, 2, 8)
    out = _kernel.finish(_kernel.merge_cache(state, q, past, positions))
    k, v = np.asarray(k)[0], np.asarray(v)[0]
    s = np.einsum("skgd,ktd->kgst", np.asarray(q), k)[..., :29] / np.sqrt(8)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    expected = np.einsum("kgst,ktd->skgd", w, v[:, :29])
    np.testing.assert_allclose(np.asarray(out), expected, atol=1e-5, rtol=0)


def test_skipping_is_visible_in_the_program(model):
    """The chunk loop holds a cond: chunks past the bound take the empty branch."""
    cache = model.init_cache(chunk=CHUNK)
    jaxpr = jax.make_jaxpr(lambda c, p: model.step(jnp.int32(1), c, p, check=False))(
        cache, jnp.asarray(5, jnp.int32)
    )
    assert "cond" in str(jaxpr)
