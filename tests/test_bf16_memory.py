"""A bfloat16 model on the CPU decodes without float32 copies of its weights.

XLA:CPU multiplies bfloat16 matrices in float32, and left alone it converts every weight
once, before the decode loop (or the scan over blocks), holding a float32 copy of the
whole model. The compiled programs here must need less scratch memory than the weights
themselves (a float32 copy would be twice them), whatever the timing; the logits must
stay those of the float32 model, within bfloat16's rounding.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _models import random_model

from eqrope.generation._arrays import for_decoding
from eqrope.model import _decoder, _matmul

# Four blocks whose widest matrix (64 x 512) is a small part of the whole, and a small
# vocabulary: one block's float32 weight is the most a step should hold.
SIZES = (96, 64, 4, 4, 32)
OPTIONS = {"d_ff": 256, "n_kv_heads": 2}


@pytest.fixture(scope="module")
def models():
    # The same draws, in each dtype.
    return random_model(0, *SIZES, **OPTIONS), random_model(0, *SIZES, **OPTIONS, dtype="bfloat16")


def weight_nbytes(model) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))


def temp_nbytes(fn, *args) -> int:
    arrays, static = eqx.partition(args, eqx.is_array)
    run = jax.jit(lambda arrays: fn(*eqx.combine(arrays, static)))
    return run.lower(arrays).compile().memory_analysis().temp_size_in_bytes


def decode(model, cache, tokens):
    """A decode loop as `generate` runs it: one `step` per iteration of a while loop."""

    def body(t, carry):
        cache, total = carry
        logits, cache = model.step(tokens[t], cache, t, check=False)
        return cache, total + logits.astype(jnp.float32)

    total = jnp.zeros((model.vocab_size,), jnp.float32)
    return jax.lax.fori_loop(0, tokens.shape[0], body, (cache, total))[1]


def batched_decode(model, cache, tokens):
    return jax.vmap(decode, in_axes=(None, 0, 0))(model, cache, tokens)


def prefill(model, cache, ids):
    return model.prefill(ids, cache, check=False)[0]


def test_compiled_programs_hold_no_float32_weights(models):
    _, bf16 = models
    weights = weight_nbytes(bf16)
    tokens = jnp.arange(8, dtype=jnp.int32)
    unstacked = bf16.unstacked()
    cases = {
        "decode, unstacked": (decode, unstacked, unstacked.init_cache(), tokens),
        "decode, stacked": (decode, bf16, bf16.init_cache(), tokens),
        "prefill, stacked (scan over blocks)": (prefill, bf16, bf16.init_cache(), tokens),
    }
    for name, (fn, *args) in cases.items():
        temp = temp_nbytes(fn, *args)
        assert temp < weights / 2, f"{name}: {temp} bytes of scratch for {weights} bytes of weights"


def test_batched_decode_holds_no_float32_weights(models):
    """Under `jax.vmap` over rows too: XLA used to move the conversions out of the loop
    there, while `in_step`'s select read `x` beside its barrier rather than out of it."""
    _, bf16 = models
    unstacked = bf16.unstacked()
    tokens = jnp.stack([jnp.arange(8, dtype=jnp.int32)] * 2)
    temp = temp_nbytes(batched_decode, unstacked, unstacked.init_cache(2), tokens)
    assert temp < weight_nbytes(bf16) / 2


def test_without_the_ties_the_programs_copy_the_weights(models, monkeypatch):
    """The check above can fail: without the ties, XLA holds float32 weights."""
    _, bf16 = models
    for module in (_matmul, _decoder):
        monkeypatch.setattr(module, "converted_in_step", lambda w: False)
    unstacked = bf16.unstacked()
    temp = temp_nbytes(decode, unstacked, unstacked.init_cache(), jnp.arange(8, dtype=jnp.int32))
    assert temp > weight_nbytes(bf16)


def cached_logits(model, ids):
    """A stacked prefill of `ids[:8]`, then unstacked steps on the rest, as `generate`
    runs them: the logits of every position from 7 on."""
    logits, cache = model.prefill(ids[:8], model.init_cache(), check=False)
    unstacked, cache = model.unstacked(), cache.split_blocks()
    steps = [logits[-1]]
    for t in range(8, ids.shape[0] - 1):
        step, cache = unstacked.step(ids[t], cache, t, check=False)
        steps.append(step)
    return jnp.stack(steps)


def test_bfloat16_logits_track_float32(models):
    f32, bf16 = models
    ids = jax.random.randint(jax.random.PRNGKey(1), (12,), 0, SIZES[0], dtype=jnp.int32)
    reference = np.asarray(jax.jit(lambda m, ids: m(ids))(f32, ids))
    atol = 0.05 * np.abs(reference).max()
    full = jax.jit(lambda m, ids: m(ids))(bf16, ids)
    np.testing.assert_allclose(np.asarray(full.astype(jnp.float32)), reference, atol=atol)
    cached = eqx.filter_jit(cached_logits)(bf16, ids)
    np.testing.assert_allclose(np.asarray(cached.astype(jnp.float32)), reference[7:11], atol=atol)


def test_gradients_and_vmap_through_the_ties():
    x = jax.random.normal(jax.random.PRNGKey(0), (3, 4)).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.PRNGKey(1), (4, 5)).astype(jnp.bfloat16)
    loss = lambda x, w: jnp.sum(_matmul.matmul(x, w).astype(jnp.float32))
    plain = lambda x, w: jnp.sum((x @ w).astype(jnp.float32))
    for got, want in zip(jax.grad(loss, (0, 1))(x, w), jax.grad(plain, (0, 1))(x, w)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    xs, ws = jnp.stack([x, 2 * x]), jnp.stack([w, -w])
    for axes in ((0, None), (None, 0), (0, 0)):
        got = jax.vmap(_matmul.matmul, in_axes=axes)(xs if axes[0] == 0 else x, ws if axes[1] == 0 else w)
        want = jax.vmap(jnp.matmul, in_axes=axes)(xs if axes[0] == 0 else x, ws if axes[1] == 0 else w)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_generate_decodes_a_low_precision_model_as_it_is_held(models):
    """`generate` unstacks a float32 model for its decode loop, but not a bfloat16 one on
    the CPU: its steps convert each block inside the step anyway, and per-block copies
    would add most of the weights to the program's peak memory."""
    f32, bf16 = models
    assert for_decoding(f32).layout == "unstacked"
    assert for_decoding(bf16) is bf16
    held = bf16.unstacked()
    assert for_decoding(held) is held


def test_the_head_converted_in_parts_gives_the_one_products_bits():
    """`matmul_vocab` converts a bfloat16 head a part at a time; each logit is the one
    product's, bit for bit, in both orientations (a head, a tied embedding's rows), and so
    is the gradient."""
    x = jax.random.normal(jax.random.PRNGKey(0), (3, 64)).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.PRNGKey(1), (64, 500)).astype(jnp.bfloat16)  # 500: uneven parts
    assert _matmul.converted_in_step(w) and w.shape[1] >= 2 * _matmul.HEAD_CHUNKS
    parts = jax.jit(lambda x, w: _matmul.matmul_vocab(x, w, rows=False))
    rows = jax.jit(lambda x, w: _matmul.matmul_vocab(x, w, rows=True))
    np.testing.assert_array_equal(np.asarray(parts(x, w)), np.asarray(jax.jit(_matmul.matmul)(x, w)))
    np.testing.assert_array_equal(np.asarray(rows(x, w.T)), np.asarray(jax.jit(_matmul.matmul_rows)(x, w.T)))
    loss = lambda fn: lambda w: jnp.sum(fn(x, w).astype(jnp.float32))
    np.testing.assert_array_equal(
        np.asarray(jax.grad(loss(lambda x, w: _matmul.matmul_vocab(x, w, rows=False)))(w)),
        np.asarray(jax.grad(loss(_matmul.matmul))(w)),
    )


def test_the_head_is_converted_a_part_at_a_time_inside_a_loop():
    """In a decode loop, the head's parts are converted in the head's own loop: no float32
    copy of the whole table (XLA converted it once, ahead of every loop, when the parts
    were sliced from the table as it came in), and one product in the program, not one
    per part (each is a kernel, and XLA:CPU's emitters hold ~1 MiB per kernel while they
    compile)."""
    w = jax.random.normal(jax.random.PRNGKey(1), (500, 64)).astype(jnp.bfloat16)  # a tied table
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 64)).astype(jnp.bfloat16)

    def decode(x, w):
        body = lambda t, x: _matmul.matmul_vocab(x, w, rows=True)[:, :64] + x
        return jax.lax.fori_loop(0, 3, body, x)

    compiled = jax.jit(decode).lower(x, w).compile()
    table_f32 = 4 * w.size
    assert compiled.memory_analysis().temp_size_in_bytes < table_f32 / 4
    assert compiled.as_text().count(" dot(") <= 2  # the loop's part and the narrower last one
    np.testing.assert_array_equal(np.asarray(jax.jit(decode)(x, w)),
                                  np.asarray(jax.jit(lambda x, w: jax.lax.fori_loop(
                                      0, 3, lambda t, x: _matmul.matmul_rows(x, w)[:, :64] + x, x))(x, w)))
