"""The KV cache and `eqrope.generate`, checked against the uncached path and plain forwards.

Everything is compared with something the cache does not touch: `model(ids)` on the whole
text, or the uncached reference loop of `generate` (a wrapper that hides the cache
protocol). Models get random weights drawn with NumPy (no compile to build them); the
compiled programs are shared between tests by reusing one model structure.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqrope
from _generate_model import (
    BLOCKS, D_MODEL, HEADS, KV_HEADS, MAX_LEN, VOCAB, _full, assert_close, full, i32, make_model,
    random_ids,
)  # fmt: skip
from eqrope.testing import Uncached


@pytest.fixture(scope="module")
def model():
    return make_model(0)


@eqx.filter_jit
def step(model, token, cache, pos):
    return model.step(token, cache, pos)


@eqx.filter_jit
def prefill(model, ids, cache, pos):
    return model.prefill(ids, cache, pos)


def stepwise(model, ids):
    """Feed `ids` one token at a time; every position's logits and the final cache."""
    cache = model.init_cache()
    rows = []
    for t in range(ids.shape[0]):
        logits, cache = step(model, ids[t], cache, i32(t))
        rows.append(logits)
    return jnp.stack(rows), cache


# -- step and prefill ------------------------------------------------------------------------


@pytest.mark.usefixtures("precision")
def test_stepwise_logits_equal_the_full_forward(model):
    ids = random_ids(1, MAX_LEN)
    logits, _ = stepwise(model, ids)
    want = _full(model, ids)  # unpadded
    assert_close(logits[-1], want[-1])
    assert_close(logits, want)  # and at every position on the way


@pytest.mark.usefixtures("precision")
def test_prefill_equals_token_by_token(model):
    ids = random_ids(2, 12)
    step_logits, step_cache = stepwise(model, ids)
    logits, cache = prefill(model, ids, model.init_cache(), i32(0))
    assert_close(logits, step_logits)
    assert_close(cache.keys, step_cache.keys)
    assert_close(cache.values, step_cache.values)
    assert float(jnp.max(jnp.abs(cache.keys))) > 0.1  # rows were written


@pytest.mark.usefixtures("precision")
@pytest.mark.parametrize("pieces", [(4, 4, 4), (8, 1, 1, 1, 1), (1, 1, 1, 1, 8)])
def test_prefill_at_an_offset_equals_the_full_forward(model, pieces):
    """Chunks after the first have Tq < Tk: the chapter's `diagonal = 1 + Tk - Tq` trap."""
    ids = random_ids(3, sum(pieces))
    want = full(model, ids)
    cache, start = model.init_cache(), 0
    for n in pieces:
        if n == 1:
            logits, cache = step(model, ids[start], cache, i32(start))
            logits = logits[None]
        else:
            logits, cache = prefill(model, ids[start : start + n], cache, i32(start))
        assert_close(logits, want[start : start + n])
        start += n


@pytest.mark.usefixtures("precision")
def test_padded_prefill_gives_the_same_logits_and_masks_the_pads(model):
    n = 5
    ids = random_ids(5, 8)
    junk = random_ids(6, 12 - n)  # arbitrary valid tokens after the prompt
    buffer = jnp.concatenate([ids[:n], junk])
    logits, cache = prefill(model, buffer, model.init_cache(), i32(0))
    want = full(model, ids)
    assert_close(logits[:n], want[:n])
    # The rows written for the pads are stale: the next steps must not see them.
    for t in range(n, 8):
        logits, cache = step(model, ids[t], cache, i32(t))
        assert_close(logits, want[t])
    # A padded chunk at an offset, as generate's chunked prefill runs it.
    _, cache = prefill(model, ids[:4], model.init_cache(), i32(0))
    logits, cache = prefill(model, jnp.concatenate([ids[4:7], junk[:5]]), cache, i32(4))
    assert_close(logits[:3], want[4:7])
    logits, _ = step(model, ids[7], cache, i32(7))
    assert_close(logits, want[7])


@pytest.mark.usefixtures("precision")
def test_cache_read_in_small_chunks_gives_the_same_logits(model):
    """A cache `chunk` < max_len takes the chunked streaming-softmax path over the cache,
    with a last chunk that overlaps the one before it (24 = 4 * 5 + 4)."""
    ids = random_ids(24, MAX_LEN)
    want = _full(model, ids)
    _, cache = prefill(model, ids[:12], model.init_cache(chunk=5), i32(0))
    logits, cache = prefill(model, ids[12:], cache, i32(12))
    assert_close(logits, want[12:])
    cache = model.init_cache(chunk=5)
    for t in range(MAX_LEN):
        logits, cache = step(model, ids[t], cache, i32(t))
        assert_close(logits, want[t])


def block0_kv_by_hand(model, ids):
    """Block 0's keys (rotated, RoFormer Eq. 15) and values, from the weights, in NumPy."""
    x = np.asarray(model.embed, np.float64)[np.asarray(ids)]
    w = np.asarray(model.blocks.attn_norm.weight[0], np.float64)
    x = x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + model.config.norm_eps) * w
    qkv = x @ np.asarray(model.blocks.attn.wqkv[0], np.float64)
    head_dim = D_MODEL // HEADS
    k = qkv[:, HEADS * head_dim : (HEADS + KV_HEADS) * head_dim].reshape(-1, KV_HEADS, head_dim)
    v = qkv[:, (HEADS + KV_HEADS) * head_dim :].reshape(-1, KV_HEADS, head_dim)
    rotated = np.empty_like(k)
    for i in range(head_dim // 2):
        angle = np.arange(len(ids))[:, None] * 10000.0 ** (-2 * i / head_dim)
        rotated[..., 2 * i] = k[..., 2 * i] * np.cos(angle) - k[..., 2 * i + 1] * np.sin(angle)
        rotated[..., 2 * i + 1] = k[..., 2 * i] * np.sin(angle) + k[..., 2 * i + 1] * np.cos(angle)
    return rotated, v


def rows_of(block_cache):
    """One block's cache as (max_len, kv_heads, head_dim), whichever layout it is stored in."""
    block_cache = np.asarray(block_cache)
    if block_cache.shape == (KV_HEADS, MAX_LEN, D_MODEL // HEADS):
        return block_cache.transpose(1, 0, 2)
    assert block_cache.shape == (MAX_LEN, KV_HEADS, D_MODEL // HEADS)
    return block_cache


def test_cache_holds_rotated_keys_and_plain_values(model):
    ids = random_ids(23, 12)
    _, cache = prefill(model, ids, model.init_cache(), i32(0))
    keys, values = block0_kv_by_hand(model, ids)
    assert_close(rows_of(cache.keys[0])[:12], keys)
    assert_close(rows_of(cache.values[0])[:12], values)
    assert_close(rows_of(cache.keys[0])[12:], 0.0, atol=0)  # nothing else written


def test_cache_nbytes_by_hand(model):
    cache = model.init_cache()
    by_hand = 2 * BLOCKS * MAX_LEN * KV_HEADS * (D_MODEL // HEADS) * 4  # float32
    assert by_hand == 6144  # 2 * 2 * 24 * 2 * 8 * 4
    assert eqrope.cache_nbytes(model) == by_hand == cache.keys.nbytes + cache.values.nbytes
    batched = model.init_cache(batch=3)
    assert (
        eqrope.cache_nbytes(model, batch=3)
        == 3 * by_hand
        == batched.keys.nbytes + batched.values.nbytes
    )


# -- generate: cached == uncached ------------------------------------------------------------

SETTINGS = {
    "greedy": dict(),
    "temperature": dict(temperature=0.8),
    "top_k": dict(temperature=1.3, top_k=3),
    "top_p": dict(temperature=1.0, top_p=0.6),
    "top_k_and_top_p": dict(temperature=0.7, top_k=5, top_p=0.8),
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_cached_and_uncached_give_identical_tokens(model, name):
    prompt = random_ids(7, 5)
    kwargs = dict(SETTINGS[name], key=jax.random.PRNGKey(11))
    cached = eqrope.generate(model, prompt, 10, **kwargs)
    uncached = eqrope.generate(Uncached(model), prompt, 10, **kwargs)
    assert cached.shape == (15,)
    np.testing.assert_array_equal(np.asarray(cached[:5]), np.asarray(prompt))
    np.testing.assert_array_equal(np.asarray(cached), np.asarray(uncached))


def test_sampling_is_not_secretly_greedy(model):
    prompt = random_ids(7, 5)
    greedy = eqrope.generate(model, prompt, 10)
    # The model's own argmax, by hand, from full forwards of the growing text.
    text = list(np.asarray(prompt))
    for _ in range(10):
        text.append(int(jnp.argmax(full(model, i32(text))[-1])))
    np.testing.assert_array_equal(np.asarray(greedy), text)
    samples = {
        tuple(
            np.asarray(
                eqrope.generate(model, prompt, 10, temperature=1.0, key=jax.random.PRNGKey(s))
            )
        )
        for s in range(3)
    }
    assert len(samples) > 1 and tuple(text) not in samples
    # top_k=1 and a tiny top_p leave only the argmax, whatever the temperature.
    for kwargs in (dict(top_k=1), dict(top_p=1e-6)):
        out = eqrope.generate(
            model, prompt, 10, temperature=2.0, key=jax.random.PRNGKey(5), **kwargs
        )
        np.testing.assert_array_equal(np.asarray(out), text)


def test_top_k_samples_only_from_the_k_best(model):
    prompt = random_ids(8, 4)
    for seed in range(3):
        out = eqrope.generate(
            model, prompt, 12, temperature=5.0, top_k=3, key=jax.random.PRNGKey(seed)
        )
        logits = np.asarray(full(model, out[:-1]))
        for t in range(4, 16):
            best3 = np.argsort(logits[t - 1])[-3:]
            assert int(out[t]) in best3


def test_top_p_samples_only_from_the_nucleus(model):
    prompt = random_ids(8, 4)
    temperature, top_p = 2.0, 0.5
    for seed in range(3):
        out = eqrope.generate(
            model, prompt, 12, temperature=temperature, top_p=top_p, key=jax.random.PRNGKey(seed)
        )
        logits = np.asarray(full(model, out[:-1]), np.float64) / temperature
        for t in range(4, 16):
            probs = np.exp(logits[t - 1] - logits[t - 1].max())
            probs /= probs.sum()
            order = np.argsort(-probs)
            mass_before = np.cumsum(probs[order]) - probs[order]
            nucleus = order[mass_before < top_p]  # the smallest prefix reaching top_p
            assert len(nucleus) < VOCAB // 2  # the filter is doing something
            assert int(out[t]) in nucleus


@pytest.mark.usefixtures("precision")
def test_cached_equals_uncached_under_both_precisions(model):
    prompt = random_ids(9, 6)
    for kwargs in (dict(), dict(temperature=0.9, top_k=7, top_p=0.9, key=jax.random.PRNGKey(1))):
        cached = eqrope.generate(model, prompt, 9, **kwargs)
        uncached = eqrope.generate(Uncached(model), prompt, 9, **kwargs)
        np.testing.assert_array_equal(np.asarray(cached), np.asarray(uncached))


def test_chapter_variant_with_learned_positions_generates_like_the_uncached_path():
    """LayerNorm, GELU, biases and a learned position table: the cache path must index the
    table by position too."""
    chapter = make_model(5, norm="layer", mlp="gelu", bias=True, positions="learned", max_len=16)
    ids = random_ids(25, 16)
    want = _full(chapter, ids)
    logits, cache = prefill(chapter, ids[:6], chapter.init_cache(), i32(0))
    assert_close(logits, want[:6])
    for t in range(6, 9):
        logits, cache = step(chapter, ids[t], cache, i32(t))
        assert_close(logits, want[t])
    for kwargs in (dict(), dict(temperature=1.0, key=jax.random.PRNGKey(2))):
        np.testing.assert_array_equal(
            np.asarray(eqrope.generate(chapter, ids[:5], 9, **kwargs)),
            np.asarray(eqrope.generate(Uncached(chapter), ids[:5], 9, **kwargs)),
        )


# -- batches ---------------------------------------------------------------------------------


def ragged_batch(junk_seed):
    lengths = np.array([9, 4, 6])
    prompt = np.array(random_ids(junk_seed, 27)).reshape(3, 9)  # pads are random junk
    prompt[0] = np.asarray(random_ids(20, 9))
    prompt[1, :4] = np.asarray(random_ids(21, 4))
    prompt[2, :6] = np.asarray(random_ids(22, 6))
    return i32(prompt), i32(lengths)


@pytest.mark.parametrize(
    "kwargs",
    [dict(), dict(temperature=0.9, top_k=9, key=jax.random.PRNGKey(6))],
    ids=["greedy", "sampled"],
)
def test_batch_rows_equal_generating_each_row_alone(model, kwargs):
    prompt, lengths = ragged_batch(30)
    out = eqrope.generate(model, prompt, 6, prompt_lengths=lengths, pad_id=VOCAB - 1, **kwargs)
    assert out.shape == (3, 15)  # min(9 + 6, max_len)
    keys = jax.random.split(kwargs["key"], 3) if "key" in kwargs else [None] * 3
    for i in range(3):
        n = int(lengths[i])
        alone = eqrope.generate(model, prompt[i, :n], 6, **dict(kwargs, key=keys[i]))
        np.testing.assert_array_equal(np.asarray(out[i, : n + 6]), np.asarray(alone))
        np.testing.assert_array_equal(np.asarray(out[i, n + 6 :]), VOCAB - 1)
    # The pads are never attended: other junk after the prompts gives the same tokens.
    other_junk, _ = ragged_batch(31)
    assert not np.array_equal(np.asarray(other_junk), np.asarray(prompt))
    again = eqrope.generate(
        model, other_junk, 6, prompt_lengths=lengths, pad_id=VOCAB - 1, **kwargs
    )
    np.testing.assert_array_equal(np.asarray(again), np.asarray(out))


@pytest.mark.usefixtures("precision")
def test_batch_rows_stop_at_eos_and_pad(model):
    prompt, lengths = ragged_batch(30)
    free = np.asarray(eqrope.generate(model, prompt, 6, prompt_lengths=lengths))
    eos = int(free[1, 4 + 2])  # row 1's third new token
    pad = (eos + 1) % VOCAB
    gen = eqrope.generate(
        model, prompt, 6, prompt_lengths=lengths, eos_id=eos, pad_id=pad, return_logprobs=True
    )
    tokens = np.asarray(gen.tokens)
    for i in range(3):
        n = int(lengths[i])
        new = list(free[i, n : n + 6])
        stop = n + (new.index(eos) + 1 if eos in new else 6)  # eos itself is kept
        np.testing.assert_array_equal(tokens[i, :stop], free[i, :stop])
        np.testing.assert_array_equal(tokens[i, stop:], pad)
        assert int(gen.lengths[i]) == stop
        assert_close(gen.logprobs[i, stop:], np.zeros(15 - stop), atol=0)
    assert int(gen.lengths[1]) == 4 + 3
    # One row alone stops at the same place; its padding defaults to eos_id.
    alone = np.asarray(eqrope.generate(model, prompt[1, :4], 6, eos_id=eos))
    assert alone.shape == (10,)
    np.testing.assert_array_equal(alone[:7], free[1, :7])
    np.testing.assert_array_equal(alone[7:], eos)


def test_generation_stops_at_max_len(model):
    # Every call asks for more tokens than fit: the cut is the point, and it warns.
    with pytest.warns(eqrope.TruncationWarning):
        prompt = random_ids(14, 20)
        out = eqrope.generate(model, prompt, 10)  # 20 + 10 > max_len = 24
        assert out.shape == (MAX_LEN,)
        np.testing.assert_array_equal(
            np.asarray(out), np.asarray(eqrope.generate(Uncached(model), prompt, 10))
        )
        full_prompt = random_ids(15, MAX_LEN)
        np.testing.assert_array_equal(
            np.asarray(eqrope.generate(model, full_prompt, 3)), np.asarray(full_prompt)
        )
        # In a batch, a row that reaches max_len stops while the others go on.
        short = jnp.concatenate([prompt[:3], jnp.zeros(19, jnp.int32)])
        batch = jnp.stack([full_prompt[:22], short, short])
        gen = eqrope.generate(model, batch, 5, prompt_lengths=i32([22, 3, 3]), return_logprobs=True)
        assert gen.tokens.shape == (3, MAX_LEN)
        np.testing.assert_array_equal(np.asarray(gen.lengths), [MAX_LEN, 8, 8])
        np.testing.assert_array_equal(
            np.asarray(gen.tokens[0]), np.asarray(eqrope.generate(model, full_prompt[:22], 5))
        )


def test_remat_model_generates_the_same(model):
    remat = make_model(0, remat=True)
    assert remat.config.remat and not model.config.remat
    for a, b in zip(jax.tree.leaves(remat), jax.tree.leaves(model), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    prompt = random_ids(16, 5)
    for kwargs in (dict(), dict(temperature=1.0, key=jax.random.PRNGKey(8))):
        np.testing.assert_array_equal(
            np.asarray(eqrope.generate(remat, prompt, 8, **kwargs)),
            np.asarray(eqrope.generate(model, prompt, 8, **kwargs)),
        )
