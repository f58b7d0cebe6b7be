"""GRPO (`eqrope.make_grpo_step`): the objective against a NumPy computation from the
formulas, group advantages by hand, on-policy consistency (the ratio at the first update),
learning a toy reward, and bad input. Tiny models, one compile per step object."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqrope
from eqrope.rl._objective import logprobs_from_logits


VOCAB, TARGET, EOS = 16, 3, 15


def emits_target(tokens, prompt_lengths, ends):
    """The fraction of a sample's new tokens that are `TARGET` (a jittable reward)."""
    t = jnp.arange(tokens.shape[-1])
    new = (t >= prompt_lengths[:, None, None]) & (t < ends[..., None])
    hits = jnp.sum((tokens == TARGET) & new, axis=-1)
    return (hits / jnp.maximum(jnp.sum(new, axis=-1), 1)).astype(jnp.float32)


@pytest.fixture(scope="module")
def model():
    return eqrope.RotaryDecoder(VOCAB, 32, 4, 1, 32, key=jax.random.PRNGKey(0))


# Ragged prompts, padded on the right; EOS ends some samples early.
PROMPTS = np.array([[1, 2, 4, 5], [6, 7, 0, 0], [8, 9, 10, 0], [11, 12, 13, 14]], np.int32)
LENGTHS = np.array([4, 2, 3, 4], np.int32)


@pytest.fixture(scope="module")
def learned(model):
    """30 fused steps (rollout, reward, update in one program) on "emit token 3"."""
    opt = optax.adam(3e-2)
    step = eqrope.make_grpo_step(opt, emits_target, group_size=4, max_new=6, beta=0.01, updates=2, eos_id=EOS)
    policy, state, history = model, eqrope.init_optimizer(opt, model), []
    for i in range(30):
        policy, state, metrics = step(
            policy, state, PROMPTS, key=jax.random.key(i), prompt_lengths=LENGTHS, reference=model
        )
        history.append({k: float(v) for k, v in metrics.items()})
    return step, policy, history


# -- the objective, by hand ------------------------------------------------------------------


def numpy_objective(logits, tokens, old, ref, adv, mask, T, beta, lo, hi, averaging, max_new):
    """The GRPO loss and its gradient with respect to the logits, from the formulas."""
    z = logits[:, :-1] / T
    z = z - z.max(-1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
    nxt = tokens[:, 1:]
    lp = np.zeros(tokens.shape)
    lp[:, 1:] = np.log(np.take_along_axis(p, nxt[..., None], -1)[..., 0])
    r = np.exp(lp - old)
    a = adv[:, None]
    unclipped, clipped = r * a, np.clip(r, 1 - lo, 1 + hi) * a
    s = np.minimum(unclipped, clipped)
    d = ref - lp
    kl = np.exp(d) - d - 1
    per = -(s - beta * kl) * mask
    n = mask.sum(1)
    if averaging == "token":
        w = np.ones_like(per) / max(mask.sum(), 1)
    elif averaging == "sequence":
        w = np.ones_like(per) / np.maximum(n, 1)[:, None] / len(n)
    else:
        w = np.ones_like(per) / (len(n) * max_new)
    loss = (per * w).sum()
    # d per / d lp: the surrogate's r A where the unclipped term is the smaller (or equal),
    # 0 where the clip binds; the k3 term's beta (1 - exp(ref - lp)).
    ds = np.where(unclipped <= clipped, r * a, 0.0)
    dlp = (-(ds) + beta * (1 - np.exp(d))) * mask * w
    # d lp_t / d logits_{t-1} = (onehot(token_t) - softmax) / T
    onehot = np.eye(logits.shape[-1])[nxt]
    grad = np.zeros_like(logits)
    grad[:, :-1] = dlp[:, 1:, None] * (onehot - p) / T
    return loss, grad


@pytest.mark.parametrize("averaging", ["token", "sequence", "constant"])
def test_objective_and_gradient_match_numpy(model, averaging):
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, VOCAB, (6, 9)), jnp.int32)
    logits = np.asarray(jax.vmap(model)(tokens), np.float64)
    mask = np.zeros((6, 9), bool)
    for i, (s, e) in enumerate([(3, 9), (2, 5), (4, 8), (3, 3), (1, 9), (5, 7)]):
        mask[i, s:e] = True
    T = 0.7
    lp = np.asarray(logprobs_from_logits(jnp.asarray(logits, jnp.float32), tokens, T)[0], np.float64)
    # old log-probs off by up to +-0.5: some ratios leave [0.8, 1.3] and are clipped
    old = lp + rng.uniform(-0.5, 0.5, lp.shape)
    ref = lp + rng.uniform(-1.0, 1.0, lp.shape)
    adv = rng.normal(size=6)
    kw = dict(beta=0.3, eps_low=0.2, eps_high=0.3, averaging=averaging, max_new=6)

    def loss_of(lg):
        logp, _ = logprobs_from_logits(lg, tokens, T)
        terms = eqrope.grpo_objective(logp, jnp.asarray(old, jnp.float32), jnp.asarray(ref, jnp.float32),
                                      jnp.asarray(adv, jnp.float32), jnp.asarray(mask), **kw)
        return terms.loss, terms

    (loss, terms), grad = jax.value_and_grad(loss_of, has_aux=True)(jnp.asarray(logits, jnp.float32))
    want, want_grad = numpy_objective(logits, np.asarray(tokens), old, ref, adv, mask, T, 0.3, 0.2, 0.3,
                                      averaging, 6)
    assert 0 < int(terms.clipped.sum()) < int(mask.sum())  # the clip binds on some tokens only
    assert abs(float(terms.kl.sum())) > 0.1  # and the KL term counts
    np.testing.assert_allclose(float(loss), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-4, atol=1e-6)


def test_group_advantages_by_hand():
    rewards = jnp.array([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [3.0, 0.0, 0.0, 0.0]])
    # group 0: mean 0.5, unbiased std sqrt(1/3); group 1 all equal; group 2: mean 0.75,
    # unbiased std sqrt((2.25^2 + 3 * 0.75^2) / 3) = 1.5
    s0 = np.sqrt(1 / 3)
    want = np.array([[0.5, -0.5, -0.5, 0.5], [0, 0, 0, 0], [2.25, -0.75, -0.75, -0.75]])
    got = np.asarray(eqrope.group_advantages(rewards))
    scale = np.array([[s0 + 1e-4], [1e-4], [1.5 + 1e-4]])
    np.testing.assert_allclose(got, want / scale, rtol=1e-6)
    assert np.all(got[1] == 0) and np.isfinite(got).all()
    np.testing.assert_allclose(np.asarray(eqrope.group_advantages(rewards, scale=False)), want, rtol=1e-6)


# -- consistency: the ratio at the first update -----------------------------------------------


def test_plain_ragged_eos_ratio_is_one_and_rollout_agrees(model, learned):
    step, _, history = learned
    assert all(h["ratio_error"] == 0.0 for h in history)  # exp(logp - logp) at update 1
    # the rollout's model_logprobs against the training forward, through training
    assert max(h["rollout_gap"] for h in history) < 1e-6
    assert min(h["length_mean"] for h in history) < 6  # EOS ended some samples


def test_adapter_host_reward_ratio_is_one(model):
    policy = eqrope.lora(model, rank=2, alpha=4, targets=("q", "v"), dropout=0.0, key=jax.random.PRNGKey(1))
    opt = optax.adam(1e-2)
    letters = "abcdefghijklmnop"
    host = eqrope.HostReward(fn=lambda prompt, text: float(text.count("d")) / max(len(text), 1),
                             decode=lambda ids: "".join(letters[i] for i in ids))
    step = eqrope.make_grpo_step(opt, host, group_size=3, max_new=5, beta=0.05, eos_id=EOS)
    state = eqrope.init_adapter_optimizer(opt, policy)
    base_leaves = jax.tree.leaves(eqrope.base_model(policy))
    for i in range(2):  # the reference is the base, for free; nothing recompiles at step 2
        policy, state, m = step(policy, state, PROMPTS, key=jax.random.key(i), prompt_lengths=LENGTHS)
        assert float(m["ratio_error"]) == 0.0 and float(m["rollout_gap"]) < 1e-6
    assert float(m["kl"]) > 0  # the adapters moved away from the base
    assert all(a is b for a, b in zip(jax.tree.leaves(eqrope.base_model(policy)), base_leaves))


def test_int8_cache_is_refused_by_name():
    with pytest.raises(ValueError, match="int8"):
        eqrope.make_grpo_step(optax.sgd(0.1), emits_target, group_size=2, max_new=2, cache_dtype="int8")


# -- learning -----------------------------------------------------------------------------------


def test_toy_reward_rises_well_above_chance(learned):
    _, _, history = learned
    first = history[0]["reward_mean"]  # the samples before any update
    last = np.mean([h["reward_mean"] for h in history[-3:]])
    assert first < 0.3  # chance is 1/16; the untrained model's own preference adds some
    assert last > 0.7 and last - first > 0.5


# -- bad input ----------------------------------------------------------------------------------


def test_group_of_one_is_refused():
    with pytest.raises(ValueError, match="group_size must be an int >= 2"):
        eqrope.make_grpo_step(optax.sgd(0.1), emits_target, group_size=1, max_new=2)


def test_bad_rewards_are_refused(model, learned):
    step, _, _ = learned
    state = eqrope.init_optimizer(optax.adam(3e-2), model)
    # a rollout's arrays, by hand: the rewards are checked before anything runs
    tokens = jnp.zeros((4, 4, 10), jnp.int32)
    r = eqrope.Rollout(tokens, jnp.zeros((4, 4, 10)), jnp.asarray(LENGTHS), jnp.full((4, 4), 10, jnp.int32))
    with pytest.raises(ValueError, match=r"shape \(batch, group\) = \(4, 4\)"):
        step.update(model, state, r, np.zeros((4, 3), np.float32), reference=model)
    with pytest.raises(TypeError, match="floats"):
        step.update(model, state, r, np.zeros((4, 4), np.int32), reference=model)
    with pytest.raises(ValueError, match="NaN"):
        step.update(model, state, r, np.full((4, 4), np.nan, np.float32), reference=model)
    # a device reward of the wrong shape or dtype, at trace time
    flat = eqrope.make_grpo_step(optax.adam(3e-2), lambda t, p, e: emits_target(t, p, e)[:, 0],
                                 group_size=4, max_new=6, eos_id=EOS, beta=0.0)
    with pytest.raises(ValueError, match="one number per sample"):
        flat(model, state, PROMPTS, key=jax.random.key(0), prompt_lengths=LENGTHS)


def test_bad_reference_is_refused(model, learned):
    step, _, _ = learned
    state = eqrope.init_optimizer(optax.adam(3e-2), model)
    other = eqrope.RotaryDecoder(VOCAB, 32, 4, 2, 32, key=jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="reference does not match the policy"):
        step(model, state, PROMPTS, key=jax.random.key(0), prompt_lengths=LENGTHS, reference=other)
    with pytest.raises(ValueError, match="needs a reference"):
        step(model, state, PROMPTS, key=jax.random.key(0), prompt_lengths=LENGTHS)
