"""The textbook's model variants: exact parameter counts, and the cache for every variant.

The chapter (../shared/seeds/001_…) gives three parameter counts and no architecture. Its
models are GPT-style pre-norm blocks: LayerNorm with weight and bias, attention q/k/v/o
with biases, a GELU MLP with biases and `d_ff = 4 * d_model`, and an untied head with a
bias. The counts below are derived by hand, per component, from that description (and
from the seed page's RMSNorm/SwiGLU/no-bias model for 139,777), not read off the code.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import Array, Int

import eqrope
import eqrope.testing


CHAPTER = dict(norm="layer", mlp="gelu", bias=True)


def gpt_block_params(d: int, d_ff: int) -> int:
    """One chapter block: two LayerNorms, biased q/k/v/o, biased GELU MLP."""
    layer_norms = 2 * (d + d)  # weight + bias, before attention and before the MLP
    attention = 3 * (d * d + d) + (d * d + d)  # q, k, v projections, then o
    mlp = (d * d_ff + d_ff) + (d_ff * d + d)  # in and out, each with a bias
    return layer_norms + attention + mlp


def gpt_decoder_params(vocab: int, d: int, blocks: int, d_ff: int, table_rows: int = 0) -> int:
    embedding = vocab * d
    positions = table_rows * d  # learned positions only; rotary has no table
    final_norm = d + d
    head = d * vocab + vocab  # untied, with a bias
    return embedding + positions + blocks * gpt_block_params(d, d_ff) + final_norm + head


def test_hand_counts_are_the_chapters_numbers():
    # The closed forms above, evaluated step by step for the reversal model:
    # embedding 12*64 = 768; per block 256 + 16,640 + 33,088 = 49,984, two blocks 99,968;
    # final norm 128; head 64*12 + 12 = 780. Total 768 + 99,968 + 128 + 780 = 101,644.
    assert gpt_block_params(64, 256) == 256 + 16_640 + 33_088 == 49_984
    assert gpt_decoder_params(12, 64, 2, 256) == 768 + 99_968 + 128 + 780 == 101_644
    assert gpt_decoder_params(12, 64, 2, 256, table_rows=25) == 101_644 + 25 * 64 == 103_244
    assert gpt_decoder_params(256, 256, 4, 1024) == 3_290_880


def test_rotary_reversal_model_has_101644_parameters():
    model = eqrope.RotaryDecoder(12, 64, 4, 2, 25, **CHAPTER, key=jax.random.PRNGKey(0))
    assert model.pos_embed is None
    assert eqrope.count_params(model) == gpt_decoder_params(12, 64, 2, 256) == 101_644


def test_learned_position_model_has_103244_parameters():
    model = eqrope.RotaryDecoder(
        12, 64, 4, 2, 25, **CHAPTER, positions="learned", key=jax.random.PRNGKey(0)
    )
    assert model.pos_embed.shape == (25, 64)
    expected = gpt_decoder_params(12, 64, 2, 256, table_rows=25)
    assert eqrope.count_params(model) == expected == 103_244


def test_timing_model_has_3290880_parameters():
    model = eqrope.RotaryDecoder(256, 256, 4, 4, 1024, d_ff=1024, **CHAPTER, key=jax.random.PRNGKey(0))
    assert eqrope.count_params(model) == gpt_decoder_params(256, 256, 4, 1024) == 3_290_880


def test_default_seed_model_has_139777_parameters():
    # The seed page: RMSNorm (weight only), bias-free attention, SwiGLU (gate, up, down),
    # no position table, untied head with a bias.
    vocab, d, blocks, d_ff = 65, 64, 2, 4 * 64
    block = 2 * d + 4 * d * d + 3 * d * d_ff  # two RMSNorms, q/k/v/o, gate/up/down
    expected = vocab * d + blocks * block + d + (d * vocab + vocab)
    assert expected == 4_160 + 131_328 + 64 + 4_225 == 139_777
    model = eqrope.RotaryDecoder(65, 64, 4, 2, 256, key=jax.random.PRNGKey(0))
    assert eqrope.count_params(model) == expected


# -- the cache and generation work for every variant -------------------------------------

VARIANTS = {
    "chapter_rotary": dict(**CHAPTER),
    "chapter_learned": dict(**CHAPTER, positions="learned"),
    "seed_default": dict(),
    "learned_rms_swiglu": dict(positions="learned"),
    "rotary_layer_swiglu_bias": dict(norm="layer", bias=True, rope_base=100.0),
}


def small_model(variant: str, *, key):
    return eqrope.RotaryDecoder(12, 32, 4, 2, 20, **VARIANTS[variant], key=key)


def with_random_biases(model, *, key):
    """Biases and the position table start at zero or small values; make every float
    array random so that a bias or a position row applied at the wrong place shows."""
    leaves, treedef = jax.tree_util.tree_flatten(model)
    keys = iter(jax.random.split(key, len(leaves)))
    new = [
        leaf + 0.1 * jax.random.normal(next(keys), leaf.shape, leaf.dtype)
        if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jnp.floating)
        else leaf
        for leaf in leaves
    ]
    return jax.tree_util.tree_unflatten(treedef, new)


@eqx.filter_jit
def prefill_then_steps(model, ids: Int[Array, " seq"], n_prompt: int):
    """Logits of every row of `ids`: the first `n_prompt` in one prefill, the rest one
    `step` at a time (a learned table is indexed by the position given to `step`)."""
    logits, cache = model.prefill(ids[:n_prompt], model.init_cache(), 0)

    def one(cache, t):
        step_logits, cache = model.step(ids[t], cache, t)
        return cache, step_logits

    _, stepped = jax.lax.scan(one, cache, jnp.arange(n_prompt, ids.shape[0], dtype=jnp.int32))
    return jnp.concatenate([logits, stepped])


def check_prefill_and_steps(variant):
    init_key, bias_key, ids_key = jax.random.split(jax.random.PRNGKey(1), 3)
    model = with_random_biases(small_model(variant, key=init_key), key=bias_key)
    ids = jax.random.randint(ids_key, (9,), 0, 12, dtype=jnp.int32)
    full = model(ids)
    np.testing.assert_allclose(
        np.asarray(prefill_then_steps(model, ids, 4)), np.asarray(full), atol=2e-5, rtol=2e-5
    )


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_and_steps_match_the_full_pass(variant):
    check_prefill_and_steps(variant)


@pytest.mark.parametrize("variant", ["chapter_rotary", "chapter_learned"])
def test_prefill_and_steps_match_the_full_pass_under_x64(variant):
    with jax.enable_x64(True):
        check_prefill_and_steps(variant)


def test_learned_step_depends_on_the_position():
    model = with_random_biases(
        small_model("chapter_learned", key=jax.random.PRNGKey(2)), key=jax.random.PRNGKey(3)
    )
    token = jnp.asarray(5, jnp.int32)
    empty = model.init_cache()
    # Without `filled` the cache does not refuse the gap below position 7 (on purpose here).
    unchecked = eqrope.KVCache(keys=empty.keys, values=empty.values)
    at_0, _ = model.step(token, empty, 0)
    at_7, _ = model.step(token, unchecked, 7)
    # With an empty cache the only difference between the two is the table row.
    expected_0 = model(token[None])[0]
    np.testing.assert_allclose(np.asarray(at_0), np.asarray(expected_0), atol=1e-5)
    assert float(jnp.max(jnp.abs(at_0 - at_7))) > 1e-3


@pytest.mark.parametrize("variant", ["chapter_rotary", "chapter_learned", "learned_rms_swiglu"])
def test_cached_generation_equals_uncached(variant):
    init_key, bias_key, prompt_key = jax.random.split(jax.random.PRNGKey(4), 3)
    model = with_random_biases(small_model(variant, key=init_key), key=bias_key)
    prompt = jax.random.randint(prompt_key, (3, 6), 0, 12, dtype=jnp.int32)
    lengths = jnp.asarray([6, 2, 4], jnp.int32)  # ragged rows, padded on the right
    cached = eqrope.generate(model, prompt, 10, prompt_lengths=lengths)
    plain = eqrope.generate(eqrope.testing.Uncached(model), prompt, 10, prompt_lengths=lengths)
    assert cached.shape == (3, 16)
    np.testing.assert_array_equal(np.asarray(cached), np.asarray(plain))
