"""The KV cache and `eqrope.generate`, checked against the uncached path and plain forwards.

Everything is compared with something the cache does not touch: `model(ids)` on the whole
text, or the uncached reference loop of `generate` (a wrapper that hides the cache
protocol). Models get random weights drawn with NumPy (no compile to build them); the
compiled programs are shared between tests by reusing one model structure.
"""

import math

import equinox as eqx
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqrope
from _compiles import counting
from _models import random_model
from eqrope.generation import _decode
from eqrope.testing import Uncached


VOCAB, D_MODEL, HEADS, KV_HEADS, BLOCKS, MAX_LEN, D_FF = 29, 32, 4, 2, 2, 24, 64


def make_model(seed=0, **options):
    sizes = dict(n_kv_heads=KV_HEADS, d_ff=D_FF)
    sizes.update(options)
    max_len = sizes.pop("max_len", MAX_LEN)
    return random_model(seed, VOCAB, D_MODEL, HEADS, BLOCKS, max_len, **sizes)


@pytest.fixture(scope="module")
def model():
    return make_model(0)


@eqx.filter_jit
def _full(model, ids):
    return model(ids)


def full(model, ids):
    """`model(ids)`, run padded to `max_len` so that every length shares one compile (the
    model is causal: the first rows do not see the padding)."""
    ids = jnp.asarray(ids, jnp.int32)
    n = ids.shape[0]
    padded = jnp.zeros((model.max_len,), jnp.int32).at[:n].set(ids)
    return _full(model, padded)[:n]


@eqx.filter_jit
def step(model, token, cache, pos):
    return model.step(token, cache, pos)


@eqx.filter_jit
def prefill(model, ids, cache, pos):
    return model.prefill(ids, cache, pos)


def i32(x):
    return jnp.asarray(x, jnp.int32)


def random_ids(seed, n):
    return i32(np.random.default_rng(seed).integers(0, VOCAB, size=n))


def assert_close(a, b, atol=1e-5):
    np.testing.assert_allclose(
        np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=0, atol=atol
    )


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


# -- compiled once ---------------------------------------------------------------------------


def test_generate_compiles_once_per_max_len(capsys):
    # A max_len no other test uses, so the first call must trace.
    model = make_model(3, max_len=20)
    key = jax.random.PRNGKey(0)
    with counting() as c:
        eqrope.generate(model, random_ids(0, 5), 4)
    first = c.traces["generate_program"]
    assert first == 1
    variations = [
        dict(prompt=random_ids(1, 3)),  # prompt length
        dict(prompt=random_ids(2, 11)),
        dict(max_new=1),
        dict(max_new=9),
        dict(max_new=0),
        dict(temperature=0.5, key=key),  # temperature, key None -> value
        dict(temperature=1.7, key=key),
        dict(temperature=0.5, key=jax.random.PRNGKey(9)),  # another key
        dict(temperature=0.5, key=jax.random.key(3)),  # a typed key
        dict(top_k=3),  # top_k None -> value
        dict(top_k=7, temperature=1.0, key=key),
        dict(top_p=0.9),  # top_p None -> value
        dict(top_p=0.5, top_k=2, temperature=1.0, key=key),
        dict(eos_id=3),
        dict(return_logprobs=True),
    ]
    with counting() as c:
        for change in variations:
            kwargs = dict(prompt=random_ids(0, 5), max_new=4)
            kwargs.update(change)
            prompt, max_new = kwargs.pop("prompt"), kwargs.pop("max_new")
            eqrope.generate(model, prompt, max_new, **kwargs)
    after_variations = first + c.traces["generate_program"]
    assert after_variations == 1, f"retraced for one of {variations}"
    with counting() as c:
        eqrope.generate(make_model(4, max_len=22), random_ids(0, 5), 4)  # a new max_len
        after_new_max_len = after_variations + c.traces["generate_program"]
        eqrope.generate(model, random_ids(3, 7), 2)  # back to max_len 20: compiled already
    assert after_new_max_len == 2
    assert c.traces["generate_program"] == 1
    with capsys.disabled():
        print(
            f"\ntrace counts: first call {first}, after {len(variations)} variations "
            f"{after_variations}, after a new max_len {after_new_max_len}"
        )


def test_weights_are_arguments_not_constants(model):
    prompt = random_ids(10, 5)
    before = eqrope.generate(model, prompt, 8)
    with counting() as c:
        # 1. eqx.tree_at: a head bias that makes token 7 win everywhere.
        biased = eqx.tree_at(lambda m: m.head_bias, model, model.head_bias.at[7].add(100.0))
        out = eqrope.generate(biased, prompt, 8)
        np.testing.assert_array_equal(np.asarray(out[5:]), [7] * 8)
        np.testing.assert_array_equal(
            np.asarray(out), np.asarray(eqrope.generate(Uncached(biased), prompt, 8))
        )
        # 2. An optax update that teaches the model to continue with token 11. (Plain SGD:
        # optax.adam's bias correction fails under the suite's strict dtype promotion.)
        optimizer = optax.sgd(0.5)
        train_step = eqrope.make_train_step(optimizer)
        trained, opt_state = model, eqrope.init_optimizer(optimizer, model)
        ids = jnp.concatenate([prompt[None], jnp.full((1, 7), 11, jnp.int32)], axis=1)
        ids = jnp.tile(ids, (2, 1))
        for _ in range(5):
            trained, opt_state, _ = train_step(trained, opt_state, ids[:, :-1], ids[:, 1:])
        out = eqrope.generate(trained, prompt, 8)
        assert not np.array_equal(np.asarray(out), np.asarray(before))
        assert int(jnp.sum(out[5:] == 11)) >= 4
        np.testing.assert_array_equal(
            np.asarray(out), np.asarray(eqrope.generate(Uncached(trained), prompt, 8))
        )
    assert c.traces["generate_program"] == 0  # neither new model retraced


# -- log-probabilities and their gradient ----------------------------------------------------


def recomputed_logprobs(model, tokens, start, temperature=1.0):
    """log p(tokens[t] | tokens[:t]) for t >= start, from one plain forward pass."""
    logits = full(model, tokens[:-1]).astype(jnp.float32) / temperature
    logp = jax.nn.log_softmax(logits, axis=-1)
    t = jnp.arange(start, tokens.shape[0])
    return logp[t - 1, tokens[t]]


@pytest.mark.parametrize("temperature", [0.0, 1.0, 2.0])
def test_logprobs_equal_a_plain_forward_pass(model, temperature):
    prompt = random_ids(12, 5)
    key = jax.random.PRNGKey(2) if temperature > 0 else None
    gen = eqrope.generate(model, prompt, 8, temperature=temperature, key=key, return_logprobs=True)
    assert isinstance(gen, eqrope.Generation)
    np.testing.assert_array_equal(
        np.asarray(gen.tokens),
        np.asarray(eqrope.generate(model, prompt, 8, temperature=temperature, key=key)),
    )
    assert int(gen.lengths) == 13 and gen.logprobs.shape == (13,)
    assert_close(gen.logprobs[:5], np.zeros(5), atol=0)
    # Greedy reports the model's own log-probabilities (temperature 1).
    want = recomputed_logprobs(model, gen.tokens, 5, temperature if temperature > 0 else 1.0)
    assert_close(gen.logprobs[5:], want)


@pytest.mark.parametrize(
    "temperature, top_k, top_p", [(1.5, 3, None), (1.0, None, 0.7), (0.8, 6, 0.9)]
)
def test_logprobs_under_top_k_and_top_p_by_hand(model, temperature, top_k, top_p):
    """The log-probability of each token under the distribution it was sampled from:
    logits / temperature, restricted to the top k, then to the nucleus, renormalised."""
    prompt = random_ids(12, 5)
    gen = eqrope.generate(
        model,
        prompt,
        8,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        key=jax.random.PRNGKey(3),
        return_logprobs=True,
    )
    logits = np.asarray(full(model, gen.tokens[:-1]), np.float64) / temperature
    for t in range(5, 13):
        row = logits[t - 1]
        keep = np.ones(VOCAB, bool)
        if top_k is not None:
            keep &= row >= np.sort(row)[-top_k]
        if top_p is not None:
            probs = np.where(keep, np.exp(row - row.max()), 0.0)
            probs /= probs.sum()
            order = np.argsort(-probs)
            mass_before = np.cumsum(probs[order]) - probs[order]
            nucleus = np.zeros(VOCAB, bool)
            nucleus[order[mass_before < top_p]] = True
            keep &= nucleus
        token = int(gen.tokens[t])
        assert keep[token]
        kept = row[keep]
        want = row[token] - (kept.max() + np.log(np.sum(np.exp(kept - kept.max()))))
        assert abs(float(gen.logprobs[t]) - want) < 1e-5


def test_grad_of_logprobs_equals_grad_of_recomputed_logprobs(model):
    prompt = random_ids(13, 4)
    for kwargs in (dict(temperature=1.0, key=jax.random.PRNGKey(4)), dict()):
        tokens = eqrope.generate(model, prompt, 6, **kwargs)

        def through_generate(m, kwargs=kwargs):
            return eqrope.generate(m, prompt, 6, return_logprobs=True, **kwargs).logprobs.sum()

        def recomputed(m, tokens=tokens):  # the same tokens, held fixed
            return recomputed_logprobs(m, tokens, 4).sum()

        value, grads = eqx.filter_value_and_grad(through_generate)(model)
        want_value, want = eqx.filter_value_and_grad(recomputed)(model)
        assert_close(value, want_value)
        leaves, want_leaves = jax.tree.leaves(grads), jax.tree.leaves(want)
        assert (
            len(leaves)
            == len(want_leaves)
            == len(jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)))
        )
        assert max(float(jnp.max(jnp.abs(g))) for g in want_leaves) > 1e-2  # not all zero
        for g, w in zip(leaves, want_leaves, strict=True):
            assert_close(g, w, atol=2e-5)


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


# -- the cached path's work ------------------------------------------------------------------


def sub_jaxprs(eqn):
    for value in eqn.params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, jax.extend.core.ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, jax.extend.core.Jaxpr):
                yield v


def all_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in sub_jaxprs(eqn):
            yield from all_eqns(sub)


def matmul_flops(jaxpr):
    """2 * output size * contracted size, summed over every dot_general (all branches)."""
    total = 0
    for eqn in all_eqns(jaxpr):
        if eqn.primitive.name == "dot_general":
            (lhs_contract, _), _ = eqn.params["dimension_numbers"]
            contracted = math.prod(eqn.invars[0].aval.shape[d] for d in lhs_contract)
            total += 2 * math.prod(eqn.outvars[0].aval.shape) * contracted
    return total


def run_flops(jaxpr):
    """`matmul_flops` of one run: a scan's body counts once per iteration (the stacked
    prefill scans its blocks, the decode step unrolls them), every branch of a cond."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            total += matmul_flops(_one(eqn))
        times = eqn.params["length"] if eqn.primitive.name == "scan" else 1
        total += times * sum(run_flops(sub) for sub in sub_jaxprs(eqn))
    return total


def _one(eqn):
    """A stand-in jaxpr holding `eqn` alone, for `matmul_flops`."""
    return type("One", (), {"eqns": [eqn]})()


def dims(jaxpr):
    return {
        d
        for eqn in all_eqns(jaxpr)
        if eqn.primitive.name == "dot_general"
        for var in eqn.invars
        for d in var.aval.shape
    }


def test_decode_loop_runs_one_token_per_step_not_the_prompt(model):
    """In the jaxpr of the generate program, the decode loop's body does the matmuls of
    exactly one `model.step` per row, and none of the prefill chunk's shape."""
    chunk = 6  # no model dimension is 6
    batch = 1
    buffer = np.zeros((batch, MAX_LEN), np.int32)
    args = (
        model,
        buffer,
        np.array([5], np.int32),
        i32(4),
        eqrope.generation._sampling.Sampling(
            temperature=jnp.asarray(0.0, jnp.float32),
            top_k=i32(VOCAB),
            top_p=jnp.asarray(1.0, jnp.float32),
            eos=i32([-1]),
        ),
        jax.random.key(0),
    )
    program = lambda *a: _decode.generate_cached(*a, batched=True, chunk=chunk)
    closed = eqx.filter_make_jaxpr(program)(*args)[0]
    loops = [e for e in all_eqns(closed.jaxpr) if e.primitive.name == "while"]
    # Two while loops run the model (hold matmuls): the prefill's over the chunks, whose
    # body works on chunks of the prompt, and the decode loop, whose body never does.
    running = [e for e in loops if matmul_flops(e.params["body_jaxpr"].jaxpr) > 0]
    prefill_loop = [e for e in running if chunk in dims(e.params["body_jaxpr"].jaxpr)]
    decode = [e for e in running if chunk not in dims(e.params["body_jaxpr"].jaxpr)]
    assert len(running) == 2 and len(decode) == 1 and len(prefill_loop) == 1
    decode_body = decode[0].params["body_jaxpr"].jaxpr
    prefill_body = prefill_loop[0].params["body_jaxpr"].jaxpr

    # generate decodes on the unstacked layout (per-block weights and cache buffers).
    decoding = model.unstacked()
    one_step = jax.make_jaxpr(jax.vmap(lambda t, c, p: decoding.step(t, c, p, check=False)))(
        i32([1]), decoding.init_cache(batch=batch), i32([5])
    )
    assert matmul_flops(decode_body) == matmul_flops(one_step.jaxpr)

    # The head matmul of the decode body makes one row of logits per sequence, and so
    # does the prefill's: only the row of a prompt's last token goes through the head.
    def head_outputs(jaxpr):
        return [
            e.outvars[0].aval.shape
            for e in all_eqns(jaxpr)
            if e.primitive.name == "dot_general" and e.outvars[0].aval.shape[-1] == VOCAB
        ]

    assert head_outputs(decode_body) and all(
        math.prod(shape) == batch * VOCAB for shape in head_outputs(decode_body)
    )
    assert head_outputs(prefill_body) and all(
        math.prod(shape) == batch * VOCAB for shape in head_outputs(prefill_body)
    )
    assert run_flops(prefill_body) > (chunk - 1) * run_flops(decode_body)


class CountingDecoder(eqx.Module):
    """Delegates the cache protocol to `inner`, and reports each executed step/prefill,
    once per row (under `vmap` a callback sees every row at once)."""

    inner: eqrope.RotaryDecoder

    @property
    def max_len(self):
        return self.inner.max_len

    @property
    def vocab_size(self):
        return self.inner.vocab_size

    def init_cache(self, batch=None, **kwargs):
        CACHE_ROWS.append(kwargs.get("max_len"))  # at trace time: the rows asked for
        return self.inner.init_cache(batch, **kwargs)

    def prefill(self, ids, cache, pos=0, **kwargs):
        record = lambda p, t: EXECUTED.extend([("prefill", int(p))] * np.size(t))  # noqa: E731
        jax.debug.callback(record, pos, ids[0])
        return self.inner.prefill(ids, cache, pos, **kwargs)

    def step(self, token, cache, pos, **kwargs):
        jax.debug.callback(lambda p: EXECUTED.extend(("step", int(q)) for q in np.ravel(p)), pos)
        return self.inner.step(token, cache, pos, **kwargs)


EXECUTED = []
CACHE_ROWS = []


def test_work_follows_the_tokens_generated_not_max_len(capsys):
    inner = random_model(1, VOCAB, 16, 2, 1, 4096, d_ff=32)
    wrapped = CountingDecoder(inner)
    prompt = random_ids(17, 4)
    EXECUTED.clear()
    out = eqrope.generate(wrapped, prompt, 6)
    jax.effects_barrier()
    steps = [p for kind, p in EXECUTED if kind == "step"]
    prefills = [p for kind, p in EXECUTED if kind == "prefill"]
    with capsys.disabled():
        print(f"\nmax_len 4096, 6 new tokens: {len(prefills)} prefill chunk(s), steps at {steps}")
    assert out.shape == (10,)
    assert prefills == [0]  # one chunk holds the whole prompt
    assert len(steps) <= 6 and steps == list(range(4, 4 + len(steps)))
    # And the tokens are right: each is the argmax of a plain forward pass of the text.
    logits = eqx.filter_jit(lambda m, ids: m(ids))(inner, out[:-1])
    np.testing.assert_array_equal(np.asarray(out[4:]), np.asarray(jnp.argmax(logits[3:], axis=-1)))
