"""The GRPO objective: group-normalised advantages, the rollout's log-probabilities under a
model, and the clipped ratio loss with the k3 KL to a reference.

Everything here is a pure function of arrays (and a model), so the step
(`_step.py`) can put it in one program with the rollout, and the tests can check it
against a hand computation.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from .._checks import as_scalar, check_bool, check_choice, check_float, check_int, is_real
from .._custom_types import IntLike, RealLike


AVERAGING = ("token", "sequence", "constant")


def group_advantages(
    rewards: Float[Array, "batch group"], *, scale: bool = True, eps: RealLike = 1e-4
) -> Float[Array, "batch group"]:
    """Group-normalised advantages: each reward minus its group's mean, divided by the
    group's standard deviation (`scale=True`, GRPO) or not (`scale=False`, Dr. GRPO).

    **Arguments:**

    - `rewards`: `(batch, group)`, the `group >= 2` samples of each prompt.
    - `scale`: divide by the group's unbiased standard deviation plus `eps`.
    - `eps`: keeps a group whose rewards are all equal at advantage 0 (not NaN).

    **Returns:** float32 advantages of the rewards' shape.

    Raises `ValueError` for rewards of another rank, and for a group of one (`group = 1`,
    whose unbiased standard deviation is 0 / 0: a lone sample has nothing to be compared
    with, and GRPO refuses `group_size < 2` too).

    ??? cite "References"

        GRPO: Shao et al. 2024, "DeepSeekMath", Sec. 4.1.2, `A_i = (r_i - mean(r)) / std(r)`.
        Dr. GRPO: Liu et al. 2025, "Understanding R1-Zero-Like Training", Sec. 3.1,
        `A_i = r_i - mean(r)`.
    """
    scale = check_bool(scale, "scale")
    eps = check_float(eps, "eps")
    rewards = jnp.asarray(rewards)
    if rewards.ndim != 2 or rewards.shape[1] < 2:
        raise ValueError(
            "rewards must have shape (batch, group) with group >= 2 (each prompt's samples "
            f"in a row, compared within it), got shape {rewards.shape}."
        )
    rewards = rewards.astype(jnp.float32)
    centred = rewards - jnp.mean(rewards, axis=1, keepdims=True)
    if not scale:
        return centred
    std = jnp.std(rewards, axis=1, keepdims=True, ddof=1)
    return centred / (std + eps)


def rollout_logprobs(
    model, tokens: Int[Array, "rows seq"], temperature: Float[ArrayLike, ""]
) -> tuple[Float[Array, "rows seq"], Float[Array, "rows seq"]]:
    """Each token's log-probability under `model` at `temperature`, from one training
    forward over the whole text, as `eqrope.generate` reports its `model_logprobs`:
    `log_softmax(float32(logits) / T)` (T = 1 when `temperature` is 0).

    **Returns:** `(logprobs, entropy)`, `(rows, seq)`: at position `t >= 1`, the
    log-probability of `tokens[:, t]` given `tokens[:, :t]`, and the entropy of that
    distribution; 0 at position 0.
    """
    logits = jax.vmap(model)(tokens).astype(jnp.float32)
    return logprobs_from_logits(logits, tokens, temperature)


def logprobs_from_logits(
    logits: Float[Array, "rows seq vocab"], tokens: Int[Array, "rows seq"], temperature: Float[ArrayLike, ""]
) -> tuple[Float[Array, "rows seq"], Float[Array, "rows seq"]]:
    """`rollout_logprobs` from the logits of a forward over `tokens`."""
    temperature = jnp.asarray(temperature).astype(jnp.float32)
    scaled = logits.astype(jnp.float32) / jnp.where(temperature > 0, temperature, 1.0)
    logp = jax.nn.log_softmax(scaled[:, :-1], axis=-1)
    picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    pad = jnp.zeros((tokens.shape[0], 1), jnp.float32)
    return jnp.concatenate([pad, picked], axis=1), jnp.concatenate([pad, entropy], axis=1)


def completion_mask(
    prompt_lengths: Int[Array, " rows"], ends: Int[Array, " rows"], seq: int
) -> Bool[Array, "rows seq"]:
    """`True` at each row's sampled tokens: positions `prompt_lengths <= t < ends`."""
    t = jnp.arange(seq)[None, :]
    return (t >= prompt_lengths[:, None]) & (t < ends[:, None])


class Terms(NamedTuple):
    """The per-token pieces of the objective (for the metrics and the tests)."""

    loss: Float[Array, ""]
    ratio: Float[Array, "rows seq"]
    kl: Float[Array, "rows seq"]
    clipped: Bool[Array, "rows seq"]


def grpo_objective(
    logprobs: Float[Array, "rows seq"],
    old_logprobs: Float[Array, "rows seq"],
    ref_logprobs: Float[Array, "rows seq"] | None,
    advantages: Float[Array, " rows"],
    mask: Bool[Array, "rows seq"],
    *,
    beta: Float[ArrayLike, ""],
    eps_low: Float[ArrayLike, ""],
    eps_high: Float[ArrayLike, ""],
    averaging: str,
    max_new: IntLike,
) -> Terms:
    """The GRPO loss (to minimise) over the sampled tokens (`mask`):

    `r_t = exp(logp_t - old_t)`, `s_t = min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A)`,
    `kl_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1` (the k3 estimator), and the
    per-token loss `l_t = -(s_t - beta kl_t)`, averaged by `averaging`:

    - `"token"`: `sum_{i,t} l / sum_i |o_i|` (DAPO's token-level average);
    - `"sequence"`: `mean_i (1 / |o_i|) sum_t l` (GRPO's sequence-level average);
    - `"constant"`: `sum_{i,t} l / (rows * max_new)` (Dr. GRPO: no length bias).

    `ref_logprobs=None` (with `beta=0`) leaves the KL term out: it is not computed at all,
    as TRL skips it at `beta == 0`, so a token whose log-probability is below -88 (whose
    `exp(-logp)` overflows float32) cannot turn the loss into `0 * inf = NaN`. Terms that
    weigh nothing cannot either: masked tokens, a traced `beta` of 0, a zero advantage,
    and a ratio past the clip where the surrogate is flat in it (where `A >= 0` the ratio
    is capped at `e (1 + eps_high)`, past the clip: the loss and its gradient are unchanged).

    **Returns:** `Terms(loss, ratio, kl, clipped)`; `clipped` marks the tokens whose
    clipped term is the smaller (no gradient flows through the ratio there); `kl` is zero
    without a reference.

    ??? cite "References"

        Shao et al. 2024, "DeepSeekMath", Eq. 3 (the objective) and Eq. 4 (k3 KL, after
        Schulman 2020, "Approximating KL divergence"); Yu et al. 2025, "DAPO", Eq. 8
        (token-level average, `eps_high`); Liu et al. 2025, "Dr. GRPO", Eq. 3.
    """
    averaging = check_choice(averaging, "averaging", AVERAGING)
    max_new = check_int(max_new, "max_new", minimum=1)
    if ref_logprobs is None and not (is_real(beta) and as_scalar(beta) == 0):
        raise ValueError("ref_logprobs=None leaves the KL term out; pass beta=0.0 with it.")
    keep = mask.astype(jnp.float32)
    a = advantages.astype(jnp.float32)[:, None]
    low, high = 1 - jnp.asarray(eps_low, jnp.float32), 1 + jnp.asarray(eps_high, jnp.float32)
    log_ratio = jnp.where(mask, logprobs - old_logprobs, 0.0)
    # Where A >= 0 the surrogate stops growing at 1 + eps_high (and is 0 at A = 0): capped
    # there at e (1 + eps_high), exp cannot overflow into a 0 * inf in the loss or its gradient.
    capped = jnp.where(a >= 0, jnp.minimum(log_ratio, jnp.log(high) + 1), log_ratio)
    ratio = jnp.exp(capped)
    unclipped, clipped = ratio * a, jnp.clip(ratio, low, high) * a
    surrogate = jnp.minimum(unclipped, clipped)
    if ref_logprobs is None:
        kl = jnp.zeros_like(keep)
        per_token = -surrogate * keep
    else:
        beta = jnp.asarray(beta, jnp.float32)
        delta = jnp.where(mask & (beta != 0), ref_logprobs - logprobs, 0.0)
        kl = jnp.exp(delta) - delta - 1
        per_token = -(surrogate - beta * kl) * keep
    lengths = jnp.sum(keep, axis=1)
    if averaging == "token":
        loss = jnp.sum(per_token) / jnp.maximum(jnp.sum(lengths), 1.0)
    elif averaging == "sequence":
        loss = jnp.mean(jnp.sum(per_token, axis=1) / jnp.maximum(lengths, 1.0))
    else:
        loss = jnp.sum(per_token) / (mask.shape[0] * max_new)
    ratio = jax.lax.stop_gradient(jnp.exp(log_ratio))  # reported as it is, uncapped
    return Terms(loss=loss, ratio=ratio, kl=kl * keep, clipped=mask & (clipped < unclipped))
