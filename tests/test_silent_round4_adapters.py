"""Issue 32 ("Nothing silent, round 4"), the adapter items.

- B5: merging and unmerging a float64 model sum in float64 (against a NumPy merge).
- B6: a fresh adapter (B = 0) on a bfloat16 model gives the base's logits bit for bit:
  `LoraWeight` takes the unadapted layer's own product (`model/_matmul.py`).
- B10: the adapter train step and the full train step refuse each other's optimizer
  state, naming the init to use.
- B11: an adapter file without its `"adapter"` record is named, with the missing key.
- B13: `generate` with adapters chosen for N rows refuses a 1-D prompt before compiling.

Tiny models drawn with NumPy; B6 compiles two forwards, nothing else compiles.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqrope
from _adapters import ALL, adapted, base, call, ids, perturbed


# -- B5: float64 merges in float64 ---------------------------------------------------------


def numpy_merge(w: eqrope.LoraWeight) -> np.ndarray:
    """`W + scale * A @ B` on each part's columns, in float64 NumPy."""
    out, start = np.array(w.weight, np.float64), 0
    for p, width in zip(w.parts, w.widths):
        if p is not None:
            out[..., start : start + width] += p.scale * (np.asarray(p.a, np.float64) @ np.asarray(p.b, np.float64))
        start += width
    return out


def test_b5_merge_and_unmerge_of_a_float64_model_sum_in_float64():
    with jax.enable_x64(True):
        model = base(dtype="float64")
        adapted_model = perturbed(eqrope.lora(model, rank=4, targets=("q", "down"), key=jax.random.key(1)))
        merged = eqrope.merge(adapted_model)
        for w, m in ((adapted_model.blocks.attn.wqkv, merged.blocks.attn.wqkv),
                     (adapted_model.blocks.mlp.w_down, merged.blocks.mlp.w_down)):  # fmt: skip
            assert m.dtype == jnp.float64
            np.testing.assert_allclose(np.asarray(m), numpy_merge(w), rtol=0, atol=1e-14)
        back = eqrope.base_model(eqrope.unmerge(merged, adapted_model))
        for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(model)):
            assert got.dtype == want.dtype
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-14)


# -- B6: a fresh adapter on a bfloat16 model ------------------------------------------------


def test_b6_fresh_adapter_on_bf16_is_bitwise_the_base():
    model = base(dtype="bfloat16")
    fresh = eqrope.lora(model, rank=4, targets=ALL, key=jax.random.key(4))  # B = 0
    x = ids(12)
    want = np.asarray(call(model, x).astype(jnp.float32))
    got = np.asarray(call(fresh, x).astype(jnp.float32))
    assert got.tobytes() == want.tobytes(), np.abs(got - want).max()


# -- B10: the optimizer state of the other kind ----------------------------------------------


def test_b10_train_steps_refuse_the_other_kind_of_optimizer_state():
    opt = optax.adam(1e-2)
    model = base()
    adapters = adapted(targets=("q", "v"), model=model)
    x = ids(10)[None]
    with pytest.raises(TypeError, match=r"the adapter train step: opt_state .* eqrope.init_adapter_optimizer"):
        eqrope.make_adapter_train_step(opt)(adapters, eqrope.init_optimizer(opt, adapters), x, x)
    with pytest.raises(TypeError, match=r"the train step: opt_state .* eqrope.init_optimizer\(optimizer, model\)"):
        eqrope.make_train_step(opt)(model, eqrope.init_adapter_optimizer(opt, adapters), x, x)


# -- B11: an adapter file without its settings ----------------------------------------------


@pytest.mark.parametrize("drop", ["adapter", "rank"])
def test_b11_adapter_file_without_its_record_is_named(tmp_path, drop):
    model = base()
    folder = eqrope.save_adapter(tmp_path / "a", adapted(targets=("q",), model=model))
    file = folder / "eqrope_adapter.json"
    record = json.loads(file.read_text())
    record.pop("adapter") if drop == "adapter" else record["adapter"].pop("rank")
    file.write_text(json.dumps(record))
    match = '"adapter" record \\(missing\\)' if drop == "adapter" else "\"adapter\" record lacks 'rank'"
    with pytest.raises(ValueError, match=match) as error:
        eqrope.load_adapter(model, folder)
    assert str(file) in str(error.value)


# -- B13: adapters chosen per row, and a 1-D prompt -------------------------------------------


def test_b13_rows_of_adapters_refuse_a_1d_prompt():
    model = base()
    many = eqrope.stack_adapters([adapted(seed=s, targets=("q",), model=model) for s in range(2)])
    selected = eqrope.select_adapters(many, [0, 1])
    assert selected.fixed_rows == 2 and many.fixed_rows is None and model.fixed_rows is None
    with pytest.raises(ValueError, match=r"chosen for 2 rows .* needs a \(2, seq\) prompt.* got a 1-D prompt"):
        eqrope.generate(selected, np.array([1, 2, 3], np.int32), 2)
