"""Many adapters of one base in one program: per-row adapters in `generate`, and
`eqx.filter_vmap` of the adapter train step over stacked adapters (a learning-rate
sweep). Each is pinned against the same adapter run on its own."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqrope
from _adapters import adapted, base, call, ids
from _compiles import counting


@pytest.fixture(scope="module")
def three():
    model = base()
    return [adapted(seed=s, targets=("q", "v", "o", "down"), model=model) for s in range(3)]


def test_each_row_generates_with_its_own_adapter(three):
    many = eqrope.stack_adapters(three)
    prompts = np.stack([np.asarray(ids(7, seed=s)) for s in range(4)])
    lengths = np.array([7, 4, 6, 7])
    assignment = [2, 0, 1, 2]
    with counting() as first:
        out = eqrope.generate(eqrope.select_adapters(many, assignment), prompts, 9, prompt_lengths=lengths)
    for row, k in enumerate(assignment):
        alone = eqrope.generate(three[k], prompts[row, : lengths[row]], 9)
        np.testing.assert_array_equal(out[row, : len(alone)], alone)
    assert max(first.compiles.values()) == 1, first.compiles  # one program for the batch
    # A new assignment of adapters to rows compiles nothing.
    with counting() as again:
        other = eqrope.generate(eqrope.select_adapters(many, [1, 1, 0, 2]), prompts, 9, prompt_lengths=lengths)
    assert sum(again.compiles.values()) == 0, again.compiles
    for row, k in enumerate([1, 1, 0, 2]):
        alone = eqrope.generate(three[k], prompts[row, : lengths[row]], 9)
        np.testing.assert_array_equal(other[row, : len(alone)], alone)
    # The unstacked layout (generation's) gives the same tokens.
    unstacked = eqrope.select_adapters(eqrope.stack_adapters([m.unstacked() for m in three]), assignment)
    np.testing.assert_array_equal(eqrope.generate(unstacked, prompts, 9, prompt_lengths=lengths), out)


def test_take_adapter_and_mixed_ranks(three):
    many = eqrope.stack_adapters(three)
    x = ids(9)
    assert np.array_equal(call(eqrope.take_adapter(many, 1), x), call(three[1], x))
    # Ranks 2 and 4, alphas 8 and 3: padded and folded, each update unchanged.
    small = adapted(seed=7, targets=("q", "v", "o", "down"), rank=2, alpha=3.0, model=base())
    mixed = eqrope.stack_adapters([three[0], small])
    np.testing.assert_allclose(call(eqrope.take_adapter(mixed, 1), x), call(small, x), rtol=1e-5, atol=1e-5)


def test_vmapped_train_step_sweeps_learning_rates_in_one_compile(three):
    rates = jnp.asarray([1e-3, 1e-2, 3e-2])
    opt = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)
    many = eqrope.stack_adapters(three)
    axes = eqrope.adapter_axes(many)

    def init(lr, model):
        state = eqrope.init_adapter_optimizer(opt, model)
        state.hyperparams["learning_rate"] = lr
        return state

    states = eqx.filter_vmap(init, in_axes=(0, axes))(rates, many)
    step = eqrope.make_adapter_train_step(opt)
    sweep = eqx.filter_jit(eqx.filter_vmap(step, in_axes=(axes, 0, None, None), out_axes=(axes, 0, 0)))
    data = np.random.default_rng(0).integers(0, 53, (4, 13))
    x, y = jnp.asarray(data[:, :-1], jnp.int32), jnp.asarray(data[:, 1:], jnp.int32)
    with counting() as c:
        for _ in range(3):
            many, states, losses = sweep(many, states, x, y)
    assert sum(c.compiles.values()) == 1, c.compiles
    assert losses.shape == (3,)
    for k in range(3):
        model, state = three[k], init(rates[k], three[k])
        for _ in range(3):
            model, state, loss = step(model, state, x, y)
        np.testing.assert_allclose(losses[k], loss, rtol=1e-5)
        for u, v in zip(jax.tree.leaves(eqrope.take_adapter(many, k)), jax.tree.leaves(model)):
            np.testing.assert_allclose(u, v, rtol=1e-4, atol=1e-6)


def test_misuse_is_named(three):
    many = eqrope.stack_adapters(three)
    with pytest.raises(ValueError, match=r"adapter_ids holds \[3\], outside \[0, 3\)"):
        eqrope.select_adapters(many, [0, 3])
    with pytest.raises(ValueError, match="adapter_ids must have rank 1"):
        eqrope.select_adapters(many, [[0]])
    with pytest.raises(ValueError, match="adapts other projections"):
        eqrope.stack_adapters([three[0], adapted(targets=("q",), model=base())])
    with pytest.raises(ValueError, match="different base arrays"):
        eqrope.stack_adapters([three[0], adapted(targets=("q", "v", "o", "down"), model=base(seed=5))])
    with pytest.raises(ValueError, match="are 3 stacked adapters"):
        call(many, ids(4))
    with pytest.raises(ValueError, match="takes a model from eqrope.stack_adapters"):
        eqrope.take_adapter(three[0], 0)
    selected = eqrope.select_adapters(many, [0, 1])
    with pytest.raises(ValueError, match="chosen for 2 rows"):
        eqrope.generate(selected, np.zeros((3, 4), np.int32), 2)
    with pytest.raises(ValueError, match="num_samples .* does not run with adapters chosen per row"):
        eqrope.generate(selected, np.zeros((2, 4), np.int32), 2, num_samples=2)
