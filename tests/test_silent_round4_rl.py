"""Issue 32 ("Nothing silent, round 4"), the GRPO items, and issue 33's items 8 and 11.

- B3: `beta=0` computes no KL term (nor its metric), so a sampled token below -88
  cannot make the loss `0 * inf`; no zero-weight term of the objective makes a NaN.
- B4, B7, B15: every argument of `make_grpo_step` (and `lora`'s key, the train steps'
  optimizer and loss) is checked by name.
- B8: `group_advantages` refuses a group of one and rewards of another rank.
- B9: a host reward outside float32's range is called that, with the reward's name.
- B10: the GRPO step refuses the optimizer state of the other kind of model.
- Issue 33: a reward's result and kind are named; `GRPOStep` and `HostReward` print their
  settings.

Under pytest the jaxtyping/beartype hook refuses a wrongly typed argument (a string for
a float) before the library's own check runs, so those cases run once in a subprocess
without the hook (`test_b15_type_errors_without_the_hook`). Tiny models and rollouts
by hand; the one step that compiles is B3's update.
"""

import math
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqrope
from _models import random_model
from _unhooked import messages_without_the_hook


VOCAB, TARGET, EOS = 16, 3, 15
PROMPTS = np.array([[1, 2, 4, 5], [6, 7, 0, 0]], np.int32)
LENGTHS = np.array([4, 2], np.int32)


def emits_target(tokens, prompt_lengths, ends):
    t = jnp.arange(tokens.shape[-1])
    new = (t >= prompt_lengths[:, None, None]) & (t < ends[..., None])
    return (jnp.sum((tokens == TARGET) & new, -1) / jnp.maximum(jnp.sum(new, -1), 1)).astype(jnp.float32)


@pytest.fixture(scope="module")
def model():
    return random_model(0, VOCAB, 32, 4, 1, 32)


def hand_rollout(batch=2, group=2, total=8):
    """A rollout's arrays by hand (prompts of 4 tokens, 2 new each): no compile."""
    tokens = np.tile(np.arange(total, dtype=np.int32) % VOCAB, (batch, group, 1))
    ends = np.full((batch, group), 6, np.int32)
    return eqrope.Rollout(tokens, np.zeros(tokens.shape, np.float32), np.full((batch,), 4, np.int32), ends)


# -- B3: beta = 0 has no KL term ------------------------------------------------------------


def test_b3_beta_zero_skips_the_kl_term(model):
    # A model sure to stop: EOS's logit is 120 above the rest, so every other token has a
    # log-probability near -120 (exp(120) overflows float32), as min_new makes a rollout
    # sample them. The samples are by hand, of lengths 2, 4 | 3, 1 after 4 prompt tokens.
    sure = eqx.tree_at(lambda m: m.head_bias, model, model.head_bias.at[EOS].set(120.0))
    opt = optax.sgd(1e-2)
    step = eqrope.make_grpo_step(opt, emits_target, group_size=2, max_new=4, beta=0.0, eos_id=EOS, min_new=2)
    tokens = np.random.default_rng(0).integers(0, EOS, (2, 2, 8)).astype(np.int32)
    starts, ends = np.array([4, 4], np.int32), np.array([[6, 8], [7, 5]], np.int32)
    rollout = eqrope.Rollout(tokens, np.zeros(tokens.shape, np.float32), starts, ends)
    logits = np.asarray(jax.vmap(sure)(jnp.asarray(tokens.reshape(4, 8))), np.float64)
    assert (logits[..., EOS] - np.delete(logits, EOS, -1).max(-1)).min() > 100  # logp < -100
    rewards = np.array([[1.0, 0.0], [0.25, 0.75]], np.float32)
    new, _, metrics = step.update(sure, eqrope.init_optimizer(opt, sure), rollout, rewards)
    assert "kl" not in metrics  # as TRL: no reference, no KL metric
    # NumPy: at the first update the ratio is exactly 1, so the clipped objective without
    # KL is -sum_i A_i |o_i| / sum_i |o_i| (token averaging).
    r = rewards.astype(np.float64)
    adv = (r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-4)
    n = (ends - starts[:, None]).astype(np.float64)
    np.testing.assert_allclose(float(metrics["loss"]), -(adv * n).sum() / n.sum(), rtol=1e-5)
    # sgd: the new parameters are finite exactly when the gradients are, and they moved.
    before = jax.tree.leaves(eqx.filter(sure, eqx.is_inexact_array))
    after = jax.tree.leaves(eqx.filter(new, eqx.is_inexact_array))
    assert all(np.isfinite(np.asarray(a)).all() for a in after)
    assert any(not np.array_equal(a, b) for a, b in zip(after, before))


@pytest.mark.parametrize("beta", [0.0, "array"])
def test_b3_zero_weight_terms_cannot_make_nan(beta):
    # Row 0 has advantage 0, row 1 a positive one with its ratio far past the clip; both
    # log-ratios (100) and the reference's gap (100) overflow exp in float32.
    beta = jnp.float32(0.0) if beta == "array" else beta
    logp = jnp.asarray([[0.0, -1.0, -2.0, -0.5], [-0.3, -0.2, -4.0, -1.0]], jnp.float32)
    old, ref = logp - 100.0, logp + 100.0
    mask = jnp.ones((2, 4), bool)
    adv = jnp.asarray([0.0, 1.0], jnp.float32)

    def loss(lp):
        return eqrope.grpo_objective(lp, old, ref, adv, mask, beta=beta, eps_low=0.2, eps_high=0.2,
                                     averaging="token", max_new=4).loss  # fmt: skip

    value, grad = jax.value_and_grad(loss)(logp)
    # By hand: row 0 gives 0, row 1 the clipped -(1.2 * 1) per token, over 8 tokens; the
    # clip binds on row 1, so no gradient flows anywhere.
    np.testing.assert_allclose(float(value), -1.2 * 4 / 8, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(grad), np.zeros((2, 4)))


# -- B4, B7, B15: the step's arguments ------------------------------------------------------


def make(**changes):
    kwargs = dict(group_size=2, max_new=2, beta=0.0)
    kwargs.update(changes)
    return eqrope.make_grpo_step(optax.sgd(0.1), emits_target, **kwargs)


@pytest.mark.parametrize("high", [float("nan"), -0.5, float("inf")])
def test_b4_clip_eps_high_is_checked(high):
    with pytest.raises(ValueError, match="clip_eps_high must be a finite number"):
        make(clip_eps_high=high)


def test_b7_max_new_below_one_is_refused():
    with pytest.raises(ValueError, match="max_new must be a positive int, got 0"):
        make(max_new=0, averaging="constant")
    z = jnp.zeros((1, 2))
    with pytest.raises(ValueError, match="max_new must be a positive int"):
        eqrope.grpo_objective(z, z, None, jnp.ones(1), z > 0, beta=0.0, eps_low=0.2, eps_high=0.2,
                              averaging="constant", max_new=0)  # fmt: skip


@pytest.mark.parametrize(
    "changes, error, match",
    [
        (dict(temperature=float("inf")), ValueError, "temperature must be a finite number, got inf"),
        (dict(updates=True), TypeError, r"updates must be a positive int, got True \(bool\)"),
        (dict(group_size=True), TypeError, r"group_size must be an int >= 2, got True \(bool\)"),
        (dict(beta=float("nan")), ValueError, "beta must be a finite number, got nan"),
        (dict(max_len=0), ValueError, "max_len must be a positive int"),
        (dict(num_samples=3), TypeError, "sets num_samples to group_size"),
        (dict(topk=3), TypeError, "unknown keyword 'topk'.*top_k"),
    ],
)
def test_b15_every_grpo_argument_is_checked(changes, error, match):
    with pytest.raises(error, match=match):
        make(**changes)


NO_HOOK = """
import jax, jax.numpy as jnp, optax, eqrope
model = eqrope.RotaryDecoder(16, 32, 4, 1, 32, key=jax.random.PRNGKey(0))
reward = lambda tokens, prompt_lengths, ends: tokens[..., 0].astype(jnp.float32)
opt = optax.sgd(0.1)
cases = {
    "clip_eps_high": lambda: eqrope.make_grpo_step(opt, reward, group_size=2, max_new=2, clip_eps_high="0.3"),
    "scale_rewards": lambda: eqrope.make_grpo_step(opt, reward, group_size=2, max_new=2, scale_rewards="no"),
    "beta": lambda: eqrope.make_grpo_step(opt, reward, group_size=2, max_new=2, beta=True),
    "averaging": lambda: eqrope.make_grpo_step(opt, reward, group_size=2, max_new=2, averaging=3),
    "optimizer": lambda: eqrope.make_grpo_step("adam", reward, group_size=2, max_new=2),
    "rewards": lambda: eqrope.group_advantages(jnp.array([1.0, 0.0])),
    "scale": lambda: eqrope.group_advantages(jnp.ones((1, 2)), scale="yes"),
    "key": lambda: eqrope.lora(model, key=None),
    "rslora": lambda: eqrope.lora(model, rslora=1, key=jax.random.key(0)),
    "adapter_optimizer": lambda: eqrope.make_adapter_train_step(None),
    "loss_fn": lambda: eqrope.make_adapter_train_step(opt, loss_fn=3),
    "train_optimizer": lambda: eqrope.make_train_step(optax.adam),
}
"""


def test_b15_type_errors_without_the_hook():
    got = messages_without_the_hook(NO_HOOK)
    want = {
        "clip_eps_high": r"TypeError: clip_eps_high must be a finite number, got '0.3' \(str\)",
        "scale_rewards": r"TypeError: scale_rewards must be True or False, got 'no' \(str\)",
        "beta": r"TypeError: beta must be a finite number, got True \(bool\)",
        "averaging": r"ValueError: averaging must be one of \('token', 'sequence', 'constant'\), got 3",
        "optimizer": r"TypeError: eqrope.make_grpo_step: optimizer must be an optax.GradientTransformation",
        "rewards": r"ValueError: rewards must have shape \(batch, group\) with group >= 2.*got shape \(2,\)",
        "scale": r"TypeError: scale must be True or False",
        "key": r"TypeError: key must be a PRNG key",
        "rslora": r"TypeError: rslora must be True or False, got 1 \(int\)",
        "adapter_optimizer": r"TypeError: eqrope.make_adapter_train_step: optimizer must be an optax",
        "loss_fn": r"TypeError: eqrope.make_adapter_train_step: loss_fn must be a function",
        "train_optimizer": r"TypeError: eqrope.make_train_step: optimizer must be an optax",
    }
    for name, pattern in want.items():
        assert re.match(pattern, got[name]), (name, got[name])


# -- B8: group advantages ----------------------------------------------------------------------


def test_b8_group_of_one_is_refused():
    with pytest.raises(ValueError, match=r"rewards must have shape \(batch, group\) with group >= 2.*\(2, 1\)"):
        eqrope.group_advantages(jnp.array([[1.0], [2.0]]))
    with pytest.raises(ValueError, match="group >= 2"):
        eqrope.group_advantages(jnp.array([[1.0], [2.0]]), scale=False)


# -- B9: host rewards outside float32 -----------------------------------------------------------


@pytest.mark.parametrize("value", [1e300, -1e39, 10**400], ids=["1e300", "-1e39", "10**400"])
def test_b9_host_reward_outside_float32_is_named(value):
    def checker(prompt, text):
        return value

    host = eqrope.HostReward(fn=checker, decode=lambda ids: str(list(ids)))
    step = eqrope.make_grpo_step(optax.sgd(0.1), host, group_size=2, max_new=2, beta=0.0)
    with pytest.raises(ValueError, match=r"host reward checker returned .* for sample \(0, 0\), outside float32's range"):
        step.host_rewards(hand_rollout())
    # rewards given to `update` as float64 are checked the same way, before the cast
    with pytest.raises(ValueError, match="outside float32's range"):
        step.update(None, None, hand_rollout(), np.full((2, 2), 1e300))


def test_b9_nan_host_reward_is_still_a_nan():
    step = eqrope.make_grpo_step(optax.sgd(0.1), eqrope.HostReward(fn=lambda p, t: math.nan, decode=str),
                                 group_size=2, max_new=2, beta=0.0)  # fmt: skip
    with pytest.raises(ValueError, match=r"returned nan for sample \(0, 0\): a NaN or an infinity"):
        step.host_rewards(hand_rollout())


# -- B10: the optimizer state of the other kind -------------------------------------------------


def test_b10_grpo_refuses_the_other_kind_of_optimizer_state(model):
    opt = optax.adam(1e-2)
    step = eqrope.make_grpo_step(opt, emits_target, group_size=2, max_new=2, beta=0.0)
    adapted = eqrope.lora(model, rank=2, key=jax.random.key(1))
    rewards = np.array([[1.0, 0.0], [0.0, 1.0]], np.float32)
    with pytest.raises(TypeError, match=r"the GRPO step: opt_state .* eqrope.init_optimizer\(optimizer, model\)"):
        step.update(model, eqrope.init_adapter_optimizer(opt, adapted), hand_rollout(), rewards)
    with pytest.raises(TypeError, match=r"eqrope.init_adapter_optimizer\(optimizer, model\)"):
        step.update(adapted, eqrope.init_optimizer(opt, adapted), hand_rollout(), rewards)


# -- issue 33: the reward's kind and result; readable reprs -----------------------------------


def test_issue33_python_float_reward_is_named_by_its_type(model):
    step = eqrope.make_grpo_step(optax.sgd(0.1), lambda t, p, e: 0.5, group_size=2, max_new=2, beta=0.0)
    with pytest.raises(ValueError, match=r"got 0.5 \(float\)\. A jittable reward returns a float32 array"):
        step(model, eqrope.init_optimizer(optax.sgd(0.1), model), PROMPTS, key=jax.random.key(0))


def test_issue33_text_reward_is_told_to_use_host_reward():
    def contains_d(prompt, completion):
        return float("d" in completion)

    with pytest.raises(TypeError, match=r"reward contains_d does not take \(tokens, prompt_lengths, ends\).*eqrope.HostReward"):
        eqrope.make_grpo_step(optax.sgd(0.1), contains_d, group_size=2, max_new=2)
    with pytest.raises(TypeError, match="HostReward's fn must be a function fn\\(prompt, completion\\)"):
        eqrope.HostReward(fn=emits_target, decode=str)


def test_issue33_reprs_show_the_settings():
    def contains_d(prompt, completion):
        return float("d" in completion)

    host = eqrope.HostReward(fn=contains_d, decode=str)
    assert repr(host) == "HostReward(fn=contains_d, decode=str)"
    step = make(eos_id=EOS, top_k=5)
    text = repr(step)
    assert text.startswith("GRPOStep(reward=emits_target, group_size=2, max_new=2, temperature=1.0, beta=0.0,")
    assert "eos_id=15" in text and "top_k=5" in text and "0x" not in text
