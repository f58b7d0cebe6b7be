"""Low-rank adapters: adapting, merging, training only the adapters, adapters on disk.

Pinned against independent computations: the frozen model's own logits (a new adapter
changes nothing, bitwise), the merged dense model, the unadapted columns of a fused
projection, central finite differences in float64, and the base arrays before training.
"""

import json
import os
import subprocess
import sys
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import safetensors
import safetensors.numpy

import eqrope
from _adapters import ALL, adapted, base, bitwise_equal, call, ids, perturbed


def test_new_adapter_leaves_logits_bitwise_equal():
    model = base()
    for layout in ("stacked", "unstacked"):
        m = model.with_layout(layout)
        fresh = eqrope.lora(m, rank=4, alpha=16, targets=ALL, key=jax.random.key(0))
        assert fresh.layout == layout and isinstance(fresh, eqrope.RotaryDecoder)
        x = ids(12)
        assert np.asarray(call(fresh, x)).tobytes() == np.asarray(call(m, x)).tobytes()
        # The base arrays are the model's own, not copies, in either layout (from_hf's
        # unstacked model is adapted where it lies), and the draws are the same.
        if layout == "stacked":
            assert fresh.blocks.attn.wqkv.weight is m.blocks.attn.wqkv
            stacked = fresh
        else:
            assert all(f.attn.wqkv.weight is b.attn.wqkv for f, b in zip(fresh.blocks, m.blocks))
            assert bitwise_equal(fresh, stacked.unstacked())


def test_an_adapter_on_q_changes_only_q_columns():
    model = base()
    one = adapted(targets=("q",), model=model)
    w = one.blocks.attn.wqkv
    assert [p is not None for p in w.parts] == [True, False, False]
    block = jax.tree.map(lambda a: a[0], w)
    x = jax.random.normal(jax.random.key(1), (5, 32))
    got, plain = np.asarray(x @ block), np.asarray(x @ block.weight)
    nq = 4 * 8
    assert np.array_equal(got[:, nq:], plain[:, nq:])  # k and v untouched
    expected = plain[:, :nq] + np.asarray(x) @ np.asarray(block.parts[0].product())
    np.testing.assert_allclose(got[:, :nq], expected, rtol=1e-5, atol=1e-5)
    # gate/up the same way: an adapter on up leaves the gate columns alone.
    up = jax.tree.map(lambda a: a[1], adapted(targets=("up",), model=model).blocks.mlp.w_gate_up)
    got, plain = np.asarray(x @ up), np.asarray(x @ up.weight)
    assert np.array_equal(got[:, :128], plain[:, :128]) and not np.allclose(got[:, 128:], plain[:, 128:])


def test_merged_equals_unmerged():
    x, prompt = ids(20), ids(6, seed=3)
    for layout in ("stacked", "unstacked"):
        model = adapted(model=base().with_layout(layout))
        merged = eqrope.merge(model)
        assert isinstance(merged, eqrope.RotaryDecoder) and not eqrope.adapters._weight.lora_weights(merged)
        assert merged.layout == layout
        got, want = np.asarray(call(model, x)), np.asarray(call(merged, x))
        assert np.abs(got - want).max() / np.abs(want).max() < 1e-5
        plain = base().with_layout(layout)
        assert not np.allclose(got, np.asarray(call(plain, x)), atol=1e-2)  # it adapts
        assert bitwise_equal(eqrope.base_model(model), plain)
        back = eqrope.base_model(eqrope.unmerge(merged, model))
        for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(plain)):
            np.testing.assert_allclose(a, b, atol=1e-6)
    # Generation with the unmerged adapter (unstacked here) gives the merged model's text.
    np.testing.assert_array_equal(eqrope.generate(model, prompt, 20), eqrope.generate(merged, prompt, 20))


def test_a_merged_model_is_an_ordinary_checkpoint(tmp_path):
    """to_hf of a merged model writes plain weights, which from_hf reads back bitwise."""
    merged = eqrope.merge(adapted())
    eqrope.to_hf(merged, tmp_path, drop_head_bias=True)
    back = eqrope.from_hf(tmp_path)
    for name in ("embed", "head"):
        assert bitwise_equal(getattr(back, name), getattr(merged, name))
    assert bitwise_equal(back.stacked().blocks, merged.blocks)  # from_hf's decoding layout


def _task(seed=0, batch=8, seq=17):
    data = np.random.default_rng(seed).integers(0, 53, (batch, seq))
    return jnp.asarray(data[:, :-1], jnp.int32), jnp.asarray(data[:, 1:], jnp.int32)


def test_training_only_the_adapters_lowers_the_loss_and_freezes_the_base():
    model = eqrope.lora(base(), rank=4, alpha=8, targets=ALL, key=jax.random.key(0))
    frozen = eqrope.base_model(model)
    before = [np.asarray(a).copy() for a in jax.tree.leaves(frozen)]
    opt = optax.adam(3e-2)
    state = eqrope.init_adapter_optimizer(opt, model)
    # The optimizer state holds the adapters alone: adam's two moments of each A and B.
    adapter_size = sum(p.a.size + p.b.size for w in eqrope.adapters._weight.lora_weights(model) for p in w.parts if p)
    assert sum(x.size for x in jax.tree.leaves(state)) == 2 * adapter_size + 1
    step = eqrope.make_adapter_train_step(opt)
    x, y = _task()
    losses = []
    for _ in range(25):
        model, state, loss = step(model, state, x, y)
        losses.append(float(loss))
    assert losses[-1] < 0.8 * losses[0], losses
    for a, b in zip(jax.tree.leaves(eqrope.base_model(model)), before):
        assert np.asarray(a).tobytes() == b.tobytes()
    # Merged, the trained model is a plain checkpoint-ready decoder with the same loss.
    merged = eqrope.merge(model)
    np.testing.assert_allclose(
        eqrope.cross_entropy(merged, x, y), eqrope.cross_entropy(model, x, y), rtol=1e-5
    )


def test_gradients_equal_finite_differences():
    with jax.enable_x64(True):
        model = adapted(model=base(dtype="float64"), targets=("q", "v", "down"))
        x, y = _task(seq=9)
        adapters, rest = eqrope.adapters._lora.split_adapters(model)

        def loss(ad):  # in float64 throughout (eqrope.cross_entropy sums in float32)
            logits = jax.vmap(eqx.combine(ad, rest))(x)
            logp = jax.nn.log_softmax(logits, axis=-1)
            return -jnp.take_along_axis(logp, y[..., None], axis=-1).mean()

        grads = jax.grad(loss)(adapters)
        loss = jax.jit(loss)
        checked = 0
        for getter, index in [
            (lambda m: m.blocks.attn.wqkv.parts[0].a, (0, 3, 1)),
            (lambda m: m.blocks.attn.wqkv.parts[2].b, (1, 2, 5)),
            (lambda m: m.blocks.mlp.w_down.parts[0].a, (1, 17, 0)),
            (lambda m: m.blocks.mlp.w_down.parts[0].b, (0, 3, 30)),
        ]:
            value = getter(adapters)

            def slope(h):  # a central difference
                up = eqx.tree_at(getter, adapters, value.at[index].add(h))
                down = eqx.tree_at(getter, adapters, value.at[index].add(-h))
                return (float(loss(up)) - float(loss(down))) / (2 * h)

            # Richardson's extrapolation of two steps: O(h^4) truncation. The steps are
            # large because attention's softmax sums in float32 (STYLE.md), which leaves
            # the float64 loss with float32 rounding.
            numeric = (4 * slope(5e-3) - slope(1e-2)) / 3
            analytic = float(getter(grads)[index])
            assert abs(numeric - analytic) <= 2e-5 + 1e-3 * abs(analytic), (numeric, analytic)
            checked += abs(analytic) > 1e-4
        assert checked == 4  # every entry has a gradient to check


def test_remat_and_x64_steps_match():
    model = adapted(model=base(), targets=("q", "up"))
    remat = adapted(model=base(remat=True), targets=("q", "up"))
    opt = optax.sgd(0.1)
    step = eqrope.make_adapter_train_step(opt)
    x, y = _task(seq=9)
    a, _, la = step(model, eqrope.init_adapter_optimizer(opt, model), x, y)
    b, _, lb = step(remat, eqrope.init_adapter_optimizer(opt, remat), x, y)
    np.testing.assert_allclose(la, lb, rtol=1e-6)
    for u, v in zip(jax.tree.leaves(eqrope.adapters._lora.split_adapters(a)[0]), jax.tree.leaves(eqrope.adapters._lora.split_adapters(b)[0])):
        np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6)
    with jax.enable_x64(True):
        wide = adapted(model=base(dtype="float64"), targets=("q", "up"))
        c, _, lc = step(wide, eqrope.init_adapter_optimizer(opt, wide), x.astype(jnp.int64), y.astype(jnp.int64))
        assert c.blocks.attn.wqkv.parts[0].a.dtype == jnp.float64
        np.testing.assert_allclose(lc, la, rtol=1e-5)


def test_dropout_needs_a_key_and_draws_from_it():
    model = eqrope.lora(base(), rank=4, targets=("q", "v"), dropout=0.5, key=jax.random.key(0))
    model = perturbed(model)
    opt = optax.sgd(0.0)
    state = eqrope.init_adapter_optimizer(opt, model)
    step = eqrope.make_adapter_train_step(opt)
    x, y = _task(seq=9)
    with pytest.raises(ValueError, match="dropout > 0; pass key="):
        step(model, state, x, y)
    l1 = step(model, state, x, y, key=jax.random.key(1))[2]
    l2 = step(model, state, x, y, key=jax.random.key(2))[2]
    l1_again = step(model, state, x, y, key=jax.random.key(1))[2]
    assert float(l1) != float(l2) and float(l1) == float(l1_again)
    # Generation and the plain call use no dropout.
    assert np.array_equal(call(model, x[0]), call(model, x[0]))


def test_adapters_on_disk_round_trip_small_and_bound(tmp_path):
    model = adapted()
    path = eqrope.save_adapter(tmp_path / "ad", model)
    assert sorted(p.name for p in path.iterdir()) == ["adapter.safetensors", "eqrope_adapter.json"]
    size = os.path.getsize(path / "adapter.safetensors")
    assert size < 0.2 * sum(a.nbytes for a in jax.tree.leaves(eqrope.base_model(model)))
    for layout in ("stacked", "unstacked"):
        plain = base().with_layout(layout)
        back = eqrope.load_adapter(plain, path)
        assert back.layout == layout
        assert bitwise_equal(back.stacked(), model)
        # on the base's own arrays (an unstacked base is not stacked and copied)
        wqkv = lambda m: [b.attn.wqkv for b in (m.blocks if layout == "unstacked" else (m.blocks,))]  # noqa: E731
        assert all(w.weight is p for w, p in zip(wqkv(back), wqkv(plain), strict=True))
    # An unstacked model's adapters are written as the stacked one's, bit for bit.
    again = eqrope.save_adapter(tmp_path / "again", model.unstacked())
    files = [str(p / "adapter.safetensors") for p in (path, again)]
    first, second = (safetensors.numpy.load_file(f) for f in files)
    assert first.keys() == second.keys() and all(bitwise_equal(first[k], second[k]) for k in first)
    assert len({json.dumps(safetensors.safe_open(f, "numpy").metadata(), sort_keys=True) for f in files}) == 1
    # Saved for another base: refused, naming the field.
    other = base(n_kv_heads=4)
    with pytest.raises(ValueError, match=r"saved for another base model(.|\n)*n_kv_heads: 2 \(saved\) vs 4"):
        eqrope.load_adapter(other, path)
    # A damaged file, and a config from another save.
    record = json.loads((path / "eqrope_adapter.json").read_text())
    record["adapter"]["alpha"] = 99.0
    (path / "eqrope_adapter.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match="saved with another eqrope_adapter.json"):
        eqrope.load_adapter(base(), path)
    with pytest.raises(FileNotFoundError, match="is missing"):
        eqrope.load_adapter(base(), tmp_path / "nowhere")


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(targets=("q", "qq")), ValueError, "unknown target 'qq'"),
        (dict(targets=("q_proj",)), ValueError, "'q_proj' is PEFT's name; eqrope's is 'q'"),
        (dict(targets="q"), TypeError, "targets must be a tuple"),
        (dict(targets=()), ValueError, "targets is empty"),
        (dict(targets=("q", "q")), ValueError, "names a target twice"),
        (dict(rank=0), ValueError, "rank must be a positive int, got 0"),
        (dict(rank=-2), ValueError, "rank must be a positive int"),
        (dict(rank=True), TypeError, "rank must be a positive int"),
        (dict(alpha=0.0), ValueError, "alpha must be > 0"),
        (dict(dropout=1.0), ValueError, r"dropout must be in \[0, 1\)"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, message):
    with pytest.raises(error, match=message):
        eqrope.lora(base(), **{"key": jax.random.key(0), **kwargs})


def test_other_misuse_is_named():
    model = adapted(targets=("q",))
    with pytest.raises(TypeError, match="already has adapters"):
        eqrope.lora(model, key=jax.random.key(0))
    with pytest.raises(TypeError, match="has no adapters"):
        eqrope.merge(base())
    gelu = eqrope.RotaryDecoder(53, 32, 4, 2, 64, mlp="gelu", key=jax.random.key(0))
    with pytest.raises(ValueError, match="no 'gate' projection"):
        eqrope.lora(gelu, targets=("gate",), key=jax.random.key(0))
    with pytest.raises(TypeError, match="has no adapters"):
        eqrope.make_adapter_train_step(optax.sgd(0.1))(base(), None, *_task(seq=5))


def test_an_adapted_model_is_not_saved_exported_or_sharded_as_a_plain_one(tmp_path):
    """save, to_hf and shard take plain models: an adapted one is refused by name, with
    what to do instead."""
    from jax.sharding import AbstractMesh, AxisType

    model = adapted(targets=("q",))
    with pytest.raises(TypeError, match=r"'blocks.attn.wqkv' holds a LoraWeight.*eqrope.merge"):
        eqrope.save(tmp_path / "ckpt", model)
    with pytest.raises(TypeError, match=r"'blocks.attn.wqkv' holds a LoraWeight.*eqrope.merge"):
        eqrope.to_hf(model, tmp_path / "hf")
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "hf").exists()
    mesh = AbstractMesh((1, 1), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))
    with pytest.raises(TypeError, match="an adapter's array.*eqrope.adapter_shardings"):
        eqrope.shardings(model, mesh)


def test_adapter_shardings_follow_the_base_rules():
    from jax.sharding import AbstractMesh, AxisType

    mesh = AbstractMesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))
    model = eqrope.lora(eqrope.RotaryDecoder(256, 64, 8, 2, 32, n_kv_heads=4, key=jax.random.key(0)),
                        rank=4, targets=("q", "v", "o", "down"), key=jax.random.key(1))
    plan = eqrope.adapter_shardings(model, mesh)
    base_plan = eqrope.shardings(eqrope.base_model(model), mesh)
    qkv = plan.blocks.attn.wqkv
    assert qkv.weight.spec == base_plan.blocks.attn.wqkv.spec
    assert tuple(qkv.parts[0].b.spec) == (None, None, "model")  # q's heads, like wqkv's columns
    assert tuple(qkv.parts[0].a.spec) == (None, None, None)  # d_model replicated, as in wqkv
    assert tuple(plan.blocks.attn.wo.parts[0].a.spec) == (None, "model", None)  # wo's heads rows
    assert tuple(plan.blocks.mlp.w_down.parts[0].a.spec) == (None, "model", None)  # d_ff rows
    state = eqrope.init_adapter_optimizer(optax.adam(1e-3), model)
    state_plan = eqrope.adapter_shardings(state, mesh)
    assert state_plan[0].mu.blocks.attn.wqkv.parts[0].b.spec == qkv.parts[0].b.spec


SHARDED = textwrap.dedent(
    """
    import jax, numpy as np, optax
    import eqrope
    from jax.sharding import AxisType
    mesh = jax.make_mesh((1, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    base = eqrope.RotaryDecoder(64, 32, 4, 2, 32, n_kv_heads=4, remat=True, key=jax.random.key(0))
    model = eqrope.lora(base, rank=4, targets=("q", "v", "o", "up", "down"), key=jax.random.key(1))
    opt = optax.adam(1e-2)
    state = eqrope.init_adapter_optimizer(opt, model)
    step = eqrope.make_adapter_train_step(opt)
    x = jax.random.randint(jax.random.key(2), (4, 9), 0, 64)
    put = lambda t: jax.tree.map(jax.device_put, t, eqrope.adapter_shardings(t, mesh))
    m1, s1 = model, state
    m2, s2 = put(model), put(state)
    for _ in range(2):
        m1, s1, l1 = step(m1, s1, x[:, :-1], x[:, 1:])
        m2, s2, l2 = step(m2, s2, x[:, :-1], x[:, 1:])
    b = m2.blocks.mlp.w_down.parts[0].a
    assert "model" in str(b.sharding.spec), b.sharding
    np.testing.assert_allclose(l1, l2, rtol=1e-5)
    for u, v in zip(jax.tree.leaves(m1), jax.tree.leaves(m2)):
        np.testing.assert_allclose(u, v, rtol=1e-4, atol=1e-5)
    print("OK")
    """
)


@pytest.mark.multidevice
def test_sharded_adapter_train_step_equals_one_device():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", SHARDED], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]
