"""The two block layouts of `RotaryDecoder`: stacked (a scan) and unstacked (a Python `for`).

The stacked scan is the reference: every check runs the unstacked model against it, or
against the uncached path of the stacked model, which `generate` does not share.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqrope
from eqrope.testing import Uncached

from _models import random_model


VARIANTS = {
    "plain": dict(),
    "gqa_window_qknorm": dict(
        n_kv_heads=2,
        attention=eqrope.AttentionOptions(qk_norm=True, window=5, window_blocks=(0, 2)),
    ),
    "tied_remat": dict(tie_embeddings=True, head_bias=False, remat=True),
}


def build(name: str):
    return eqrope.RotaryDecoder(48, 32, 4, 3, 64, key=jax.random.key(3), **VARIANTS[name])


def assert_close(a, b, rtol=1e-6):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = max(np.max(np.abs(b)), 1e-30)
    assert np.max(np.abs(a - b)) <= rtol * scale, np.max(np.abs(a - b)) / scale


def test_round_trip_is_bitwise_and_layouts_are_named():
    model = build("plain")
    unstacked = model.unstacked()
    assert (model.layout, unstacked.layout) == ("stacked", "unstacked")
    assert isinstance(unstacked.blocks, tuple) and len(unstacked.blocks) == 3
    assert unstacked.unstacked() is unstacked and model.stacked() is model
    back = unstacked.stacked()
    assert jax.tree.structure(back) == jax.tree.structure(model)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(model)):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    # Each block holds its own arrays, the stack's slice.
    np.testing.assert_array_equal(unstacked.blocks[1].attn.wqkv, model.blocks.attn.wqkv[1])
    assert eqrope.count_params(unstacked) == eqrope.count_params(model)


# Compiled (one program per model and cache structure; the position is traced), so the
# eight steps of a case compile once instead of dispatching every operation.
forward = eqx.filter_jit(lambda m, ids: m(ids))
prefill = eqx.filter_jit(lambda m, ids, cache: m.prefill(ids, cache, 0))
step_at = eqx.filter_jit(lambda m, token, cache, t: m.step(token, cache, t))


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_logits_prefill_and_step_equal(name):
    model = build(name)
    unstacked = model.unstacked()
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 48, 20), jnp.int32)
    assert_close(forward(unstacked, ids), forward(model, ids))
    for dtype in (None, "int8"):
        caches = [m.init_cache(max_len=32, dtype=dtype) for m in (model, unstacked)]
        outs = []
        for m, cache in zip((model, unstacked), caches):
            logits, cache = prefill(m, ids[:12], cache)
            steps = []
            for t in range(12, 20):
                step, cache = step_at(m, ids[t], cache, jnp.int32(t))
                steps.append(step)
            outs.append((logits, jnp.stack(steps), cache))
        assert_close(outs[1][0], outs[0][0])
        if dtype is None:
            assert_close(outs[1][1], outs[0][1])
            assert_close(outs[1][2].keys, outs[0][2].keys)
        else:
            # Rounding to int8 turns a difference of one float32 ulp at a rounding
            # boundary into one quantisation step (max|x| / 127 of a row): the layouts
            # agree within a few steps, and the rows differ by at most 1.
            assert_close(outs[1][1], outs[0][1], rtol=2e-3)
            for a, b in ((outs[1][2].keys, outs[0][2].keys), (outs[1][2].values, outs[0][2].values)):
                assert np.max(np.abs(np.asarray(a, np.int32) - np.asarray(b, np.int32))) <= 1


def test_generate_greedy_and_sampled_ragged_equal_the_stacked_reference():
    model = random_model(0, 40, 32, 4, 2, 64)
    unstacked = model.unstacked()
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 40, (3, 9)).astype(np.int32)
    lengths = np.asarray([9, 4, 6], np.int32)
    for kwargs in (dict(), dict(temperature=0.8, top_k=10, key=jax.random.key(5))):
        ours = eqrope.generate(unstacked, prompt, 12, prompt_lengths=lengths, return_logprobs=True, **kwargs)
        stacked = eqrope.generate(model, prompt, 12, prompt_lengths=lengths, return_logprobs=True, **kwargs)
        # The uncached path runs the stacked scan over the whole text at every token.
        reference = eqrope.generate(
            Uncached(model), prompt, 12, prompt_lengths=lengths, return_logprobs=True, **kwargs
        )
        for other in (stacked, reference):
            np.testing.assert_array_equal(ours.tokens, other.tokens)
            np.testing.assert_allclose(ours.logprobs, other.logprobs, atol=1e-5)
            np.testing.assert_allclose(ours.model_logprobs, other.model_logprobs, atol=1e-5)


def test_speculative_with_unstacked_models_equals_plain_greedy():
    model = random_model(0, 40, 32, 4, 2, 64)
    draft = random_model(1, 40, 16, 2, 1, 64)
    prompt = np.tile(np.arange(6, dtype=np.int32), 2)
    plain = eqrope.generate(model, prompt, 16)
    for m, d in ((model.unstacked(), draft.unstacked()), (model, draft.unstacked())):
        np.testing.assert_array_equal(eqrope.generate(m, prompt, 16, draft=d), plain)
        np.testing.assert_array_equal(eqrope.generate(m, prompt, 16, draft="prompt_lookup"), plain)


def test_grad_through_generation_is_the_same_in_both_layouts():
    model = random_model(0, 40, 32, 4, 2, 64)
    prompt = np.arange(5, dtype=np.int32)

    def loss(m):
        out = eqrope.generate(m, prompt, 6, temperature=1.0, key=jax.random.key(2), return_logprobs=True)
        return out.model_logprobs.sum()

    stacked = eqx.filter_grad(loss)(model)
    unstacked = eqx.filter_grad(loss)(model.unstacked()).stacked()
    for a, b in zip(jax.tree.leaves(unstacked), jax.tree.leaves(stacked)):
        assert_close(a, b, rtol=1e-5)


def test_train_step_on_either_layout_gives_the_same_loss_and_update():
    model = build("tied_remat")
    rng = np.random.default_rng(4)
    ids = jnp.asarray(rng.integers(0, 48, (2, 10)), jnp.int32)
    targets = jnp.roll(ids, -1, axis=1)
    optimizer = optax.adam(1e-2)
    step = eqrope.make_train_step(optimizer)
    results = []
    for m in (model, model.unstacked()):
        new, _, loss = step(m, eqrope.init_optimizer(optimizer, m), ids, targets)
        results.append((new.stacked(), loss))
    assert_close(results[1][1], results[0][1])
    for a, b in zip(jax.tree.leaves(results[1][0]), jax.tree.leaves(results[0][0])):
        assert_close(a, b, rtol=1e-5)


def test_shardings_of_an_unstacked_model_drop_the_blocks_axis():
    model = build("gqa_window_qknorm")
    mesh = jax.sharding.AbstractMesh((1, 2), ("data", "model"))
    stacked = eqrope.shardings(model, mesh)
    unstacked = eqrope.shardings(model.unstacked(), mesh)
    for i in range(3):
        for a, b in zip(jax.tree.leaves(unstacked.blocks[i]), jax.tree.leaves(stacked.blocks)):
            assert tuple(a.spec) == tuple(b.spec)[1:]
    assert unstacked.embed.spec == stacked.embed.spec


def test_checkpoints_hold_the_stacked_layout_and_load_either(tmp_path):
    model = build("gqa_window_qknorm")
    eqrope.save(tmp_path / "a", model.unstacked())  # an unstacked model saves stacked
    for layout in ("stacked", "unstacked"):
        back = eqrope.load(tmp_path / "a", layout=layout)
        assert back.layout == layout
        for a, b in zip(jax.tree.leaves(back.stacked()), jax.tree.leaves(model)):
            assert np.array_equal(a, b)
    with pytest.raises(ValueError, match="layout must be 'stacked'.*'unstacked'.*got 'rows'"):
        eqrope.load(tmp_path / "a", layout="rows")
    with pytest.raises(ValueError, match="layout"):
        model.with_layout("scan")


def test_to_hf_and_from_hf_take_either_layout(tmp_path):
    model = eqrope.RotaryDecoder(48, 32, 4, 2, 64, head_bias=False, key=jax.random.key(1))
    eqrope.to_hf(model.unstacked(), tmp_path / "hf")
    back = eqrope.from_hf(tmp_path / "hf", layout="unstacked")
    assert back.layout == "unstacked"
    ids = jnp.arange(10, dtype=jnp.int32)
    np.testing.assert_array_equal(back(ids), model.unstacked()(ids))
    with pytest.raises(ValueError, match="from_hf: layout"):
        eqrope.from_hf(tmp_path / "hf", layout="layers")


def test_a_stacked_model_refuses_a_per_block_cache():
    model = build("plain")
    cache = model.unstacked().init_cache(max_len=16)
    with pytest.raises(TypeError, match="one buffer per block.*model.unstacked"):
        model.step(jnp.int32(1), cache, 0)
    # An unstacked model also takes a stacked cache, with the same logits.
    unstacked = model.unstacked()
    a, _ = unstacked.step(jnp.int32(1), model.init_cache(max_len=16), 0)
    b, _ = model.step(jnp.int32(1), model.init_cache(max_len=16), 0)
    assert_close(a, b)
