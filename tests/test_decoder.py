"""The decoder as a whole: parameter counts, batching, causality, remat, depth."""

import equinox as eqx
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import eqrope


pytestmark = pytest.mark.usefixtures("precision")


def closed_form_params(vocab, d, heads, blocks, *, d_ff=None, kv_heads=None, head_bias=True, tied=False):
    """The default (RMSNorm, SwiGLU, no projection biases) decoder, counted by hand."""
    d_ff = 4 * d if d_ff is None else d_ff
    kv_heads = heads if kv_heads is None else kv_heads
    head_dim = d // heads
    embed = vocab * d
    attention = d * heads * head_dim + 2 * d * kv_heads * head_dim + heads * head_dim * d
    swiglu = 3 * d * d_ff  # gate, up, down
    norms = 2 * d  # two RMSNorm weight vectors
    per_block = attention + swiglu + norms
    final_norm = d
    head = (0 if tied else d * vocab) + (vocab if head_bias else 0)
    return embed + blocks * per_block + final_norm + head


def test_seed_config_has_139777_parameters():
    model = eqrope.RotaryDecoder(65, 64, 4, 2, 256, key=jax.random.PRNGKey(0))
    # 65*64 + 2*(4*64*64 + 3*64*256 + 2*64) + 64 + 64*65 + 65
    assert 65 * 64 + 2 * (4 * 64 * 64 + 3 * 64 * 256 + 2 * 64) + 64 + 64 * 65 + 65 == 139_777
    assert eqrope.count_params(model) == 139_777
    assert closed_form_params(65, 64, 4, 2) == 139_777


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(d_ff=96),
        dict(kv_heads=2),
        dict(kv_heads=1),
        dict(head_bias=False),
        dict(tied=True),
    ],
)
def test_parameter_count_matches_closed_form(kwargs):
    options = dict(kwargs)
    ctor = dict(
        d_ff=options.get("d_ff"),
        n_kv_heads=options.get("kv_heads"),
        head_bias=options.get("head_bias", True),
        tie_embeddings=options.get("tied", False),
    )
    model = eqrope.RotaryDecoder(33, 32, 4, 3, 16, **ctor, key=jax.random.PRNGKey(1))
    assert eqrope.count_params(model) == closed_form_params(33, 32, 4, 3, **kwargs)


def test_blocks_are_stacked_with_a_leading_axis():
    model = eqrope.RotaryDecoder(65, 64, 4, 3, 32, key=jax.random.PRNGKey(0))
    assert model.blocks.attn.wqkv.shape == (3, 64, 3 * 64)
    assert model.blocks.mlp.w_gate_up.shape == (3, 64, 2 * 256)
    assert model.blocks.attn_norm.weight.shape == (3, 64)


def test_vmap_equals_rows():
    model = eqrope.RotaryDecoder(17, 32, 4, 2, 12, key=jax.random.PRNGKey(0))
    ids = jax.random.randint(jax.random.PRNGKey(1), (3, 12), 0, 17, dtype=jnp.int32)
    batched = jax.vmap(model)(ids)
    for row in range(3):
        np.testing.assert_allclose(batched[row], model(ids[row]), atol=1e-6, rtol=0)


def test_causality():
    model = eqrope.RotaryDecoder(17, 32, 4, 2, 12, n_kv_heads=2, key=jax.random.PRNGKey(2))
    ids = jax.random.randint(jax.random.PRNGKey(3), (12,), 0, 17, dtype=jnp.int32)
    base = model(ids)
    for j in (0, 5, 11):
        changed = model(ids.at[j].set((ids[j] + 1) % 17))
        np.testing.assert_array_equal(np.asarray(changed[:j]), np.asarray(base[:j]))
        assert not np.allclose(np.asarray(changed[j:]), np.asarray(base[j:]))


def test_remat_gradients_equal():
    kwargs = dict(n_kv_heads=2, key=jax.random.PRNGKey(4))
    plain = eqrope.RotaryDecoder(19, 32, 4, 3, 16, **kwargs)
    remat = eqrope.RotaryDecoder(19, 32, 4, 3, 16, remat=True, **kwargs)
    ids = jax.random.randint(jax.random.PRNGKey(5), (4, 16), 0, 19, dtype=jnp.int32)
    targets = jnp.roll(ids, -1, axis=1)

    def grads(model):
        return eqx.filter_grad(eqrope.cross_entropy)(model, ids, targets)

    g_plain, g_remat = grads(plain), grads(remat)
    # The two differ in static config (remat), so compare the leaves in order.
    leaves_plain, leaves_remat = jax.tree.leaves(g_plain), jax.tree.leaves(g_remat)
    assert len(leaves_plain) == len(leaves_remat)
    largest = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(leaves_plain, leaves_remat))
    assert largest <= 1e-6
    # remat really wraps the block in a checkpoint.
    jaxpr = str(jax.make_jaxpr(lambda m: eqrope.cross_entropy(m, ids, targets))(remat))
    assert "checkpoint" in jaxpr or "remat" in jaxpr


def _count_eqns(jaxpr) -> int:
    total = 0
    for eqn in jaxpr.eqns:
        total += 1
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            total += _count_eqns(sub)
    return total


def test_program_size_does_not_grow_with_depth():
    """Compile time follows program size; scanning over stacked blocks keeps it constant."""
    ids = jnp.arange(8, dtype=jnp.int32)
    sizes = []
    for blocks in (2, 24):
        model = eqrope.RotaryDecoder(65, 64, 4, blocks, 256, key=jax.random.PRNGKey(0))
        sizes.append(_count_eqns(jax.make_jaxpr(lambda m: m(ids))(model).jaxpr))
    assert sizes[0] == sizes[1]


def test_dtype_bfloat16_keeps_float32_softmax_and_norms():
    model = eqrope.RotaryDecoder(17, 32, 4, 2, 12, dtype=jnp.bfloat16, key=jax.random.PRNGKey(0))
    assert model.embed.dtype == jnp.bfloat16
    ids = jnp.arange(12, dtype=jnp.int32) % 17
    logits = model(ids)
    assert logits.dtype == jnp.bfloat16
    ref = eqrope.RotaryDecoder(17, 32, 4, 2, 12, key=jax.random.PRNGKey(0))
    # Same initial weights up to bf16 rounding: the logits agree to bf16 precision.
    np.testing.assert_allclose(
        np.asarray(logits, np.float32), np.asarray(ref(ids)), atol=0.15, rtol=0.05
    )


def test_count_params_of_an_abstract_model():
    abstract = eqx.filter_eval_shape(
        lambda: eqrope.RotaryDecoder(65, 64, 4, 2, 256, key=jax.random.PRNGKey(0))
    )
    assert eqrope.count_params(abstract) == 139_777
