"""Sharding rules, placement and the HLO collective counter, in this process.

These tests plan placements on an `AbstractMesh` of shape (data=2, model=4), so they need
no devices. tests/test_sharding_devices.py runs the same on 8 virtual CPU devices and in
two processes.
"""

from collections import Counter

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import AbstractMesh, AxisType

import eqrope
import eqrope.testing
from eqrope.weights._table import WEIGHTS, axis_counts


MESH = AbstractMesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))
SIZES = dict(vocab_size=256, d_model=64, n_heads=8, n_blocks=2, max_len=32)


def abstract_decoder(*sizes, **options):
    """A decoder's structure and shapes, without computing its arrays."""
    return jax.eval_shape(lambda: eqrope.RotaryDecoder(*sizes, **options, key=jax.random.key(0)))


def abstract_model(**options):
    return abstract_decoder(*SIZES.values(), **options)


def spec(sharding) -> tuple:
    entries = list(sharding.spec)
    while entries and entries[-1] is None:
        entries.pop()
    return tuple(entries)


# -- planning on an abstract mesh ----------------------------------------------------------


LAYOUTS = {
    "llama": dict(n_kv_heads=4, head_bias=False),
    "biased": dict(bias=True, n_kv_heads=2),
    "textbook": dict(mlp="gelu", positions="learned", norm="layer", tie_embeddings=True, bias=True),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_weight_table_has_one_row_per_array(layout):
    """The table the rules (and the Hugging Face converter) read: every array, its shape."""
    model = abstract_model(**LAYOUTS[layout])
    c = model.config
    counts = axis_counts(c)
    width = {"heads": c.head_dim, "kv_heads": c.head_dim}

    def length(axis):
        parts = axis if isinstance(axis, tuple) else (axis,)
        return sum(counts[p] * width.get(p, 1) for p in parts)

    arrays = {
        ".".join(entry.name for entry in path): leaf.shape
        for path, leaf in jax.tree_util.tree_flatten_with_path(model)[0]
    }
    rows = {w.path: tuple(map(length, w.axes)) for w in WEIGHTS if w.exists(c)}
    assert rows == arrays


def test_default_rules_place_megatron_style():
    plan = eqrope.shardings(abstract_model(n_kv_heads=4, d_ff=96, bias=True), MESH)
    attn, mlp = plan.blocks.attn, plan.blocks.mlp
    assert spec(plan.embed) == ("model",)  # vocab rows
    assert spec(plan.head) == (None, "model")  # vocab columns
    assert spec(plan.head_bias) == ("model",)
    assert spec(attn.wqkv) == (None, None, "model")  # (blocks, d_model, qkv)
    assert spec(attn.bqkv) == (None, "model")
    assert spec(attn.wo) == (None, "model")  # heads * head_dim rows
    assert spec(mlp.w_gate_up) == (None, None, "model")
    assert spec(mlp.w_down) == (None, "model")
    for replicated in (attn.bo, mlp.b_down, plan.blocks.attn_norm.weight, plan.final_norm.weight):
        assert spec(replicated) == ()


def test_other_layouts_and_changed_rules():
    model = abstract_model(mlp="gelu", positions="learned", norm="layer", tie_embeddings=True, bias=True)
    plan = eqrope.shardings(model, MESH)
    assert plan.head is None
    assert spec(plan.pos_embed) == ()
    assert spec(plan.blocks.mlp.w_in) == (None, None, "model")
    assert spec(plan.blocks.mlp.b_in) == (None, "model")
    assert spec(plan.blocks.mlp.w_out) == (None, "model")
    assert spec(plan.blocks.attn_norm.bias) == ()
    # d_model on "model" and vocab replicated: the embedding's columns are split instead.
    rules = eqrope.ShardingRules(vocab=None, d_model="model", heads=None, kv_heads=None, d_ff=None)
    plan = eqrope.shardings(model, MESH, rules)
    assert spec(plan.embed) == (None, "model")
    assert spec(plan.blocks.attn.wqkv) == (None, "model")
    # A rule may name several mesh axes: the batch over all 8 devices.
    cache = jax.eval_shape(lambda: eqrope.RotaryDecoder(**SIZES, key=jax.random.key(0)).init_cache(8))
    rules = eqrope.ShardingRules(batch=("data", "model"), heads=None, kv_heads=None)
    assert spec(eqrope.shardings(cache, MESH, rules).keys) == (("data", "model"),)


def test_fused_qkv_replicates_when_kv_heads_do():
    """Multi-query attention: one kv head cannot be split, so the fused columns are not."""
    model = abstract_model(n_kv_heads=1)
    with pytest.raises(ValueError, match=r"'kv_heads' dimension \(1\).*mesh axis 'model' \(4"):
        eqrope.shardings(model, MESH)
    plan = eqrope.shardings(model, MESH, eqrope.ShardingRules(kv_heads=None))
    assert spec(plan.blocks.attn.wqkv) == ()
    assert spec(plan.blocks.attn.wo) == (None, "model")


def test_cache_and_optimizer_state_follow_the_model():
    model = abstract_model(n_kv_heads=4)
    cache = jax.eval_shape(lambda: model.init_cache(2))
    plan = eqrope.shardings(cache, MESH)
    # (batch, blocks, kv_heads, max_len, head_dim): batch 2 on data, 4 kv heads on model.
    split = {axis: size for size, axis in zip(cache.keys.shape, plan.keys.spec) if axis}
    assert split == {"data": 2, "model": 4}
    single = eqrope.shardings(jax.eval_shape(model.init_cache), MESH)
    assert "data" not in spec(single.keys) and "model" in spec(single.keys)

    state = jax.eval_shape(
        lambda: eqrope.init_optimizer(
            optax.adam(1e-3), eqrope.RotaryDecoder(**SIZES, n_kv_heads=4, key=jax.random.key(0))
        )
    )
    plan = eqrope.shardings(state, MESH)
    params = eqrope.shardings(model, MESH)
    assert spec(plan[0].mu.blocks.attn.wqkv) == spec(params.blocks.attn.wqkv)
    assert spec(plan[0].nu.embed) == spec(params.embed)
    assert spec(plan[0].count) == ()


def test_indivisible_rules_name_the_dimension_and_the_mesh_axis():
    with pytest.raises(ValueError, match=r"'heads' dimension \(2\).*'model' \(4 devices\)"):
        eqrope.shardings(abstract_decoder(256, 64, 2, 2, 32), MESH)
    with pytest.raises(ValueError, match=r"'d_ff' dimension \(90\).*ShardingRules\(d_ff=None\)"):
        eqrope.shardings(abstract_model(d_ff=90), MESH)
    with pytest.raises(ValueError, match=r"'vocab' dimension \(250\)"):
        eqrope.shardings(abstract_decoder(250, 64, 8, 2, 32), MESH)
    cache = jax.eval_shape(lambda: eqrope.RotaryDecoder(**SIZES, key=jax.random.key(0)).init_cache(3))
    with pytest.raises(ValueError, match=r"'batch' dimension \(3\).*mesh axis 'data' \(2"):
        eqrope.shardings(cache, MESH)
    with pytest.raises(ValueError, match="two of its dimensions"):
        eqrope.shardings(abstract_model(), MESH, eqrope.ShardingRules(d_model="model"))


def test_mesh_and_rule_errors():
    with pytest.raises(ValueError, match="mesh axis 'model'.*mesh has axes \\('data',\\)"):
        eqrope.shardings(abstract_model(), AbstractMesh((8,), ("data",), axis_types=(AxisType.Auto,)))
    explicit = AbstractMesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    with pytest.raises(TypeError, match="AxisType.Auto"):
        eqrope.shardings(abstract_model(), explicit)
    with pytest.raises(TypeError, match="heads"):
        eqrope.ShardingRules(heads=4)
    with pytest.raises(TypeError, match="ShardingRules.batch"):
        eqrope.ShardingRules(batch=())


def test_one_device_mesh_places_like_no_mesh():
    mesh = eqrope.make_mesh()
    assert dict(mesh.shape) == {"data": 1, "model": 1}
    model = eqrope.RotaryDecoder(64, 16, 2, 1, 8, key=jax.random.key(0))
    placed = eqrope.shard(model, mesh)
    assert placed.embed.sharding.mesh == mesh
    assert jnp.array_equal(placed.embed, model.embed)
    ids = eqrope.shard_batch(jnp.arange(16, dtype=jnp.int32).reshape(2, 8), mesh)
    assert ids.sharding.spec[0] == "data"
    with pytest.raises(ValueError, match="needs 8 devices"):
        eqrope.make_mesh(data=2, model=4)


def test_generate_mesh_needs_the_cache_protocol_and_rules_need_a_mesh():
    class Uncached:
        max_len = 8

        def __call__(self, ids):
            return jnp.zeros((ids.shape[0], 4), jnp.float32)

    with pytest.raises(ValueError, match="cache protocol"):
        eqrope.generate(Uncached(), jnp.zeros((3,), jnp.int32), 2, mesh=eqrope.make_mesh())
    with pytest.raises(ValueError, match="pass mesh="):
        eqrope.generate(Uncached(), jnp.zeros((3,), jnp.int32), 2, rules=eqrope.ShardingRules())


# -- the collective counter, on hand-written HLO -------------------------------------------

# Devices 0..7 of a (data=2, model=4) mesh: device d sits at (d // 4, d % 4).
HLO = """
%a = f32[8]{0} all-reduce(%x), channel_id=1, replica_groups={{0,4},{1,5},{2,6},{3,7}}, use_global_device_ids=true, to_apply=%add
%b = f32[8,8]{1,0} all-gather(%x), channel_id=2, replica_groups=[2,4]<=[8], dimensions={1}
%c = f32[] all-reduce(%y), channel_id=3, replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add
%d = f32[4]{0} collective-permute(%z), channel_id=4, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
%e = (f32[1,4]{1,0}, f32[1,4]{1,0}) all-to-all(%p, %q), channel_id=5, replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_0'}, metadata={op_name="x"}
%f = f32[2]{0} reduce-scatter(%w), channel_id=6, replica_groups={}, dimensions={0}, to_apply=%add
%g = f32[8]{0} all-reduce-start(%x), channel_id=7, replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add
%h = f32[8]{0} all-reduce-done(%g)
%i = f32[8]{0} all-reduce(%x), channel_id=8, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, to_apply=%add
%j = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused, metadata={op_name="all-reduce(x)"}
%k = f32[8]{0} all-gather(%x), channel_id=9, replica_groups=unreadable, dimensions={0}
"""


def test_hlo_collectives_reads_every_spelling():
    # Worked by hand: {0,4}: data; [2,4]<=[8] = {0,1,2,3},{4,5,6,7}: model;
    # [4,2]<=[2,4]T(1,0) = {0,4},{1,5},..: data; pairs 0->1..3->0: model; device_ids
    # [0,4,1,5,2,6,3,7] on a (4,1,2) grid, groups over axis_0 = {0,1,2,3},{4,5,6,7}: model;
    # {} = all devices; {0,1},{2,3},..: model; a (2,4) grid over axis_0 = {0,4},..: data.
    assert eqrope.testing.hlo_collectives(HLO, MESH) == Counter(
        {
            ("all-reduce", ("data",)): 3,
            ("all-gather", ("model",)): 1,
            ("collective-permute", ("model",)): 1,
            ("all-to-all", ("model",)): 1,
            ("reduce-scatter", ("data", "model")): 1,
            ("all-reduce", ("model",)): 1,
            ("all-gather", ("?",)): 1,
        }
    )
