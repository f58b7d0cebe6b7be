"""One GRPO step: sample `G` completions per prompt, score them, and update the policy.

The rollout is the plain generate program (`eqrope.generation._decode.decode_program`,
one shared prefill per prompt, a `while_loop` over the new tokens), called inside the
step's own compiled program. A reward that is a jittable function of token arrays goes
into that program too: rollout, reward, advantages, the `updates` optimizer steps and the
metrics are one program. A `HostReward` (a function of decoded text) splits the step in
two programs, the rollout and the update, with the reward on the host between them.

The ratio's "old" log-probabilities are the training forward's own at the first update
(`jnp.where(first, stop_gradient(logp), old)`), so the first ratio is exactly 1 in every
precision; the rollout's `model_logprobs` come from the cached decode, which rounds
differently (it attends one query at a time), and are reported against them as the
metric `rollout_gap` (below 1e-6, relative, in float32 on the tests' models). docs/rl.md says more.
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, Int

from .._log import compiling, shapes_of
from .._checks import check_bool, check_choice, check_float, check_int
from .._custom_types import IntLike, RealLike
from ..generation._decode import decode_program
from ..generation._generation_config import GenerationConfig, resolve
from ..generation._hf_generation_config import refuse_hf_keywords
from ..generation._request import parse_request
from ._rewards import HostReward, _name, check_host_rewards, check_reward, check_rewards, host_rewards
from ._objective import AVERAGING, completion_mask, group_advantages, grpo_objective, rollout_logprobs
from ..adapters._lora import base_model, split_adapters
from ..adapters._step import ADAPTER_STATE
from ..adapters._weight import lora_weights
from ..training._step import FULL_STATE, check_opt_state, check_optimizer


class Rollout(NamedTuple):
    """The samples of one step: `tokens` `(batch, group, total)` (prompt, completion, then
    `pad_id`), the rollout's `model_logprobs` (`log_softmax(logits / T)` of each sampled
    token, 0 elsewhere), each prompt's length and each sample's end."""

    tokens: Int[Array, "batch group total"]
    model_logprobs: Float[Array, "batch group total"]
    prompt_lengths: Int[Array, " batch"]
    ends: Int[Array, "batch group"]


def _partition(model):
    """`(trainable, rest)`: the adapters of an adapted model, else every float array."""
    if lora_weights(model):
        return split_adapters(model)
    return eqx.partition(model, eqx.is_inexact_array)


def check_reference(reference, policy) -> None:
    """Raise a `ValueError` unless `reference` has the structure, shapes and dtypes of
    `policy` (of its base, for an adapted policy)."""
    base = base_model(policy) if lora_weights(policy) else policy
    if lora_weights(reference):
        raise ValueError(
            "the reference has adapters; pass a plain model, such as eqrope.merge(adapted) "
            "or the base (the default for an adapted policy)."
        )
    ref_leaves, ref_tree = jax.tree.flatten(eqx.filter(reference, eqx.is_array))
    leaves, tree = jax.tree.flatten(eqx.filter(base, eqx.is_array))
    if ref_tree != tree or getattr(reference, "config", None) != getattr(base, "config", None):
        raise ValueError(
            "the reference does not match the policy: its structure or config differs. Pass "
            "a frozen copy of the policy's (base) model, with the same config and layout."
        )
    for i, (r, p) in enumerate(zip(ref_leaves, leaves)):
        if r.shape != p.shape or r.dtype != p.dtype:
            raise ValueError(
                f"the reference does not match the policy: array {i} is {r.dtype}{list(r.shape)}, "
                f"the policy's {p.dtype}{list(p.shape)}."
            )


# The sampler's settings that `**controls` passes on (the others are make_grpo_step's own).
CONTROLS = tuple(
    f.name for f in dataclasses.fields(GenerationConfig)
    if f.name not in ("max_new", "max_total", "temperature", "eos_id", "num_samples")
)  # fmt: skip

_DEFAULTS = GenerationConfig()


def make_grpo_step(
    optimizer: optax.GradientTransformation,
    reward: Callable | HostReward,
    *,
    group_size: IntLike,
    max_new: IntLike,
    temperature: RealLike = 1.0,
    beta: RealLike = 0.04,
    clip_eps: RealLike = 0.2,
    clip_eps_high: RealLike | None = None,
    scale_rewards: bool = True,
    averaging: str = "token",
    updates: IntLike = 1,
    eos_id: IntLike | Sequence[IntLike] | None = None,
    max_len: IntLike | None = None,
    cache_dtype: str | None = None,
    **controls,
) -> "GRPOStep":
    """A GRPO step `(policy, opt_state, prompts, *, key, prompt_lengths=None,
    reference=None) -> (policy, opt_state, metrics)`.

    **Arguments:**

    - `optimizer`: an optax transformation; its state comes from
      [`eqrope.init_optimizer`][] for a full model, [`eqrope.init_adapter_optimizer`][]
      for an adapted one (only the adapters are trained).
    - `reward`: a jittable `reward(tokens, prompt_lengths, ends) -> rewards`, with
      `tokens` `(batch, group, total)`, `prompt_lengths` `(batch,)`, `ends` `(batch,
      group)` and float `rewards` `(batch, group)` (the whole step is then one program);
      or a [`eqrope.HostReward`][] of decoded text (two programs, the reward between). A
      function of two arguments, `(prompt, completion)`, is refused with the advice to
      wrap it in a `HostReward`.
    - `group_size`: `G >= 2` samples per prompt.
    - `max_new` (`>= 1`), `temperature` (finite, `> 0`), `eos_id`, `max_len` and
      `**controls` (`top_k`, `top_p`, `min_p`, penalties, `bad_ids`, `stop`, `min_new`,
      `pad_id`): the sampler's, as in [`eqrope.generate`][]. The ratio uses the model's own log-probabilities at
      `temperature`, without the processors (`model_logprobs`).
    - `beta`: the coefficient of the k3 KL to the reference. `beta=0` leaves the KL
      term out altogether, as TRL does: no reference, no reference forward, and no `kl`
      metric.
    - `clip_eps`, `clip_eps_high`: the ratio is clipped to `[1 - clip_eps, 1 +
      clip_eps_high]` (`clip_eps_high` defaults to `clip_eps`; DAPO raises it); finite
      and `>= 0`.
    - `scale_rewards`: divide the centred rewards by the group's std (GRPO); `False` is
      Dr. GRPO's unnormalised advantage.
    - `averaging`: `"token"`, `"sequence"` or `"constant"` (see `grpo_objective`).
    - `updates`: `mu`, the optimizer steps taken on each rollout batch.
    - `cache_dtype`: only `None`; `"int8"` is refused (see below).

    **Returns:** a `GRPOStep`. `metrics` holds float scalars: `reward_mean`,
    `reward_std`, `loss`, `kl` (with `beta > 0` only), `clip_fraction` (over the updates), `entropy`,
    `length_mean`, `length_max` (completion tokens), `ratio_error` (`max |ratio - 1|` at
    the first update, 0 by construction), `rollout_gap` (`max |logp - model_logprobs| /
    max(1, |logp|)` between the training forward and the rollout: float32 rounds a
    log-probability to a relative 6e-8) and `tokens` (text positions through
    the policy: the rollout's and `updates` forwards).

    The int8 cache is refused: the rollout would sample from a model whose keys and values
    are rounded to 8 bits, a different policy from the one trained, and the ratio would
    hide that difference.

    Every argument is checked here, by name, with the words of eqrope's other checks: a
    bool, a string or a NaN where a number goes, an int where a bool goes, a choice
    outside its list, an unknown sampler control. The step checks its `opt_state`
    against the optimizer's init of what it trains (a `TypeError` naming
    `eqrope.init_optimizer` or `eqrope.init_adapter_optimizer`), and each host reward
    (a NaN, an infinity, or a value outside float32's range, with the sample's index).
    """
    check_optimizer(optimizer, "eqrope.make_grpo_step")
    reward = check_reward(reward)
    group_size = check_int(group_size, "group_size", minimum=2)
    max_new = check_int(max_new, "max_new", minimum=1)
    temperature = check_float(temperature, "temperature")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (GRPO samples), got {temperature!r}.")
    beta, clip_eps = check_float(beta, "beta"), check_float(clip_eps, "clip_eps")
    clip_eps_high = clip_eps if clip_eps_high is None else check_float(clip_eps_high, "clip_eps_high")
    for name, value in (("beta", beta), ("clip_eps", clip_eps), ("clip_eps_high", clip_eps_high)):
        if value < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}.")
    scale_rewards = check_bool(scale_rewards, "scale_rewards")
    averaging = check_choice(averaging, "averaging", AVERAGING)
    updates = check_int(updates, "updates", minimum=1)
    max_len = check_int(max_len, "max_len", minimum=1, none=True)
    if cache_dtype is not None:
        raise ValueError(
            f"cache_dtype={cache_dtype!r} is refused: the GRPO rollout samples with the exact "
            "cache only. An int8 cache samples from a model whose keys and values are rounded, "
            "not the policy being trained; pass cache_dtype=None."
        )
    if "num_samples" in controls:
        raise TypeError("make_grpo_step sets num_samples to group_size; pass group_size=... alone.")
    refuse_hf_keywords(controls, "make_grpo_step")
    unknown = sorted(set(controls) - set(CONTROLS))
    if unknown:
        raise TypeError(
            f"make_grpo_step got an unknown keyword {unknown[0]!r}; the sampler's controls "
            f"are {', '.join(CONTROLS)}."
        )
    settings = resolve(
        None, dict(max_new=max_new, temperature=temperature, eos_id=eos_id, num_samples=group_size, **controls)
    )
    hyper = dict(beta=beta, eps_low=clip_eps, eps_high=clip_eps_high)
    return GRPOStep(optimizer, reward, settings, hyper, scale_rewards, averaging, updates, max_len)


class GRPOStep:
    """The step [`eqrope.make_grpo_step`][] builds; call it, or run its two halves
    (`rollout`, then `update` with rewards) to time them or to score on the host."""

    def __init__(self, optimizer, reward, settings, hyper, scale_rewards, averaging, updates, max_len):
        self.optimizer, self.reward, self.settings = optimizer, reward, settings
        self.hyper, self.scale, self.averaging = hyper, scale_rewards, averaging
        self.updates, self.max_len = updates, max_len
        self.group = settings.num_samples
        self._fused = eqx.filter_jit(self._fused_program)
        self._rollout = eqx.filter_jit(self._rollout_program)
        self._update = eqx.filter_jit(self._update_program)

    def __repr__(self) -> str:
        """The step's settings, as `make_grpo_step` took them (sampler controls only where
        they differ from the defaults)."""
        s, h = self.settings, self.hyper
        fields = dict(
            group_size=self.group, max_new=s.max_new, temperature=s.temperature, beta=h["beta"],
            clip_eps=h["eps_low"], clip_eps_high=h["eps_high"], scale_rewards=self.scale,
            averaging=self.averaging, updates=self.updates, max_len=self.max_len,
        )  # fmt: skip
        changed = [n for n in ("eos_id", *CONTROLS) if getattr(s, n) != getattr(_DEFAULTS, n)]
        fields.update({n: getattr(s, n) for n in changed})
        shown = ", ".join(f"{k}={v!r}" for k, v in fields.items())
        return f"GRPOStep(reward={_name(self.reward)}, {shown})"

    # -- the host side ---------------------------------------------------------------------

    def __call__(self, policy, opt_state, prompts, *, key, prompt_lengths=None, reference=None):
        request = self._request(policy, prompts, key, prompt_lengths)
        trainable, rest = _partition(policy)
        reference = self._reference(policy, reference)
        if isinstance(self.reward, HostReward):
            rollout = self._rollout(policy, *self._args(request), **self._static(request))
            rewards = self.host_rewards(rollout)
            trainable, opt_state, metrics = self._update(trainable, rest, opt_state, reference, rollout, rewards, request.sampling.temperature)
        else:
            trainable, opt_state, metrics = self._fused(
                trainable, rest, opt_state, reference, *self._args(request), **self._static(request)
            )
        return eqx.combine(trainable, rest), opt_state, metrics

    def rollout(self, policy, prompts, *, key, prompt_lengths=None) -> Rollout:
        """The rollout alone: `G` samples of each prompt, as one program."""
        request = self._request(policy, prompts, key, prompt_lengths)
        return self._rollout(policy, *self._args(request), **self._static(request))

    def update(self, policy, opt_state, rollout: Rollout, rewards, *, reference=None):
        """The update alone, from a `rollout` and its `(batch, group)` rewards."""
        rewards = check_host_rewards(rewards, rollout.tokens.shape[:2])
        trainable, rest = _partition(policy)
        reference = self._reference(policy, reference)
        temperature = np.float32(self.settings.temperature)
        trainable, opt_state, metrics = self._update(trainable, rest, opt_state, reference, rollout, rewards, temperature)
        return eqx.combine(trainable, rest), opt_state, metrics

    def host_rewards(self, rollout: Rollout) -> np.ndarray:
        """The `HostReward` of each sample, `(batch, group)` float32, checked."""
        return host_rewards(self.reward, rollout.tokens, rollout.prompt_lengths, rollout.ends)

    def _request(self, policy, prompts, key, prompt_lengths):
        if key is None:
            raise ValueError("the GRPO step samples; pass key=jax.random.key(step), a new key each step.")
        return parse_request(policy, prompts, self.settings, max_len=self.max_len, key=key, prompt_lengths=prompt_lengths)

    def _reference(self, policy, reference):
        if reference is not None:
            check_reference(reference, policy)
        if self.hyper["beta"] == 0:
            return None  # no KL term: no reference forward, nor the reference in the program
        if reference is not None or lora_weights(policy):
            return reference  # None: the adapted policy's base (inside the program)
        raise ValueError(
            "beta > 0 needs a reference: pass reference=... (a frozen copy of the initial "
            "model), or beta=0.0. An adapted policy's reference is its base by default."
        )

    @staticmethod
    def _args(request):
        return (request.buffer(), request.lengths, np.asarray(request.max_new, np.int32), request.sampling, request.key)

    def _static(self, request):
        if not request.batched:
            raise ValueError("the GRPO step takes a batch of prompts, (batch, seq); add a batch axis.")
        return dict(chunk=request.chunk, total=request.total, pad_id=request.pad_id)

    # -- the programs ----------------------------------------------------------------------

    def _rollout_program(self, policy, buffer, lengths, max_new, sampling, key, *, chunk, total, pad_id) -> Rollout:
        compiling("rl", "the GRPO step", f"prompts {shapes_of(buffer)}, group {self.group}", "batch or cache length")
        tokens, _, own, ends, nonfinite = decode_program(
            policy, buffer, lengths, max_new, sampling, key, batched=True, chunk=chunk, samples=self.group
        )
        tokens = eqx.error_if(tokens, nonfinite, "the policy's logits held a NaN or an infinity in the rollout.")
        inside = jnp.arange(total)[None, :] < ends[:, None]
        tokens = jnp.where(inside, tokens[:, :total], pad_id)
        shape = (buffer.shape[0], self.group, total)
        return Rollout(tokens.reshape(shape), own[:, :total].reshape(shape), lengths, ends.reshape(shape[:2]))

    def _fused_program(self, trainable, rest, opt_state, reference, buffer, lengths, max_new, sampling, key, **static):
        rollout = self._rollout_program(eqx.combine(trainable, rest), buffer, lengths, max_new, sampling, key, **static)
        rewards = self.reward(rollout.tokens, rollout.prompt_lengths, rollout.ends)
        rewards = check_rewards(rewards, buffer.shape[0], self.group)
        return self._update_program(trainable, rest, opt_state, reference, rollout, rewards, sampling.temperature)

    def _update_program(self, trainable, rest, opt_state, reference, rollout: Rollout, rewards, temperature):
        adapted = bool(lora_weights(rest))
        kind = ADAPTER_STATE if adapted else FULL_STATE
        check_opt_state(self.optimizer, trainable, opt_state, who="the GRPO step", **kind)
        batch, group, total = rollout.tokens.shape
        tokens = rollout.tokens.reshape(batch * group, total)
        starts = jnp.repeat(rollout.prompt_lengths, group)
        ends = rollout.ends.reshape(-1)
        mask = completion_mask(starts, ends, total)
        advantages = group_advantages(rewards, scale=self.scale).reshape(-1)
        hyper = self.hyper
        ref_lp = None  # beta == 0: no KL term, no reference forward (as TRL)
        if hyper["beta"] > 0:
            ref = base_model(eqx.combine(trainable, rest)) if reference is None else reference
            ref_lp = jax.lax.stop_gradient(rollout_logprobs(ref, tokens, temperature)[0])
        max_new = int(self.settings.max_new)

        def loss_of(trainable, old, first):
            logp, entropy = rollout_logprobs(eqx.combine(trainable, rest), tokens, temperature)
            old = jnp.where(first, jax.lax.stop_gradient(logp), old)
            terms = grpo_objective(logp, old, ref_lp, advantages, mask, averaging=self.averaging, max_new=max_new, **hyper)
            return terms.loss, (terms, logp, entropy)

        def one_update(carry, i):
            trainable, opt_state, old = carry
            own = rollout.model_logprobs.reshape(tokens.shape)
            (loss, (terms, logp, entropy)), grads = jax.value_and_grad(loss_of, has_aux=True)(trainable, old, i == 0)
            with jax.numpy_dtype_promotion("standard"):
                step, opt_state = self.optimizer.update(grads, opt_state, trainable)
            trainable = eqx.apply_updates(trainable, step)
            old = jnp.where(i == 0, jax.lax.stop_gradient(logp), old)
            n = jnp.maximum(jnp.sum(mask), 1).astype(jnp.float32)
            stats = dict(
                loss=loss,
                **({} if ref_lp is None else {"kl": jnp.sum(terms.kl) / n}),
                clip_fraction=jnp.sum(terms.clipped).astype(jnp.float32) / n,
                entropy=jnp.sum(jnp.where(mask, entropy, 0.0)) / n,
                ratio_error=jnp.max(jnp.where(mask, jnp.abs(terms.ratio - 1), 0.0)),
                rollout_gap=jnp.max(jnp.where(mask, jnp.abs(logp - own) / jnp.maximum(1.0, jnp.abs(logp)), 0.0)),
            )
            return (trainable, opt_state, old), stats

        carry = (trainable, opt_state, jnp.zeros(tokens.shape, jnp.float32))
        (trainable, opt_state, _), stats = jax.lax.scan(one_update, carry, jnp.arange(self.updates))
        lengths = (ends - starts).astype(jnp.float32)
        metrics = {name: value[0] for name, value in stats.items()}  # the first update's
        metrics["clip_fraction"] = jnp.mean(stats["clip_fraction"])
        metrics.update(
            reward_mean=jnp.mean(rewards),
            reward_std=jnp.std(rewards),
            length_mean=jnp.mean(lengths),
            length_max=jnp.max(lengths),
            tokens=jnp.asarray(float(batch * group * total * (1 + self.updates)), jnp.float32),
        )
        return trainable, opt_state, metrics
