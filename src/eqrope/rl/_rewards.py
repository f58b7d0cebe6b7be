"""GRPO's rewards: on the device (a jittable function of token arrays) or on the host
(`HostReward`, a function of decoded text), and the checks of what they return.
"""

import dataclasses
import inspect
import math
from collections.abc import Callable, Sequence

import equinox as eqx
import jax.numpy as jnp
import numpy as np

from .._checks import as_scalar, is_real


@dataclasses.dataclass(frozen=True)
class HostReward:
    """A reward computed on the host from decoded text: `fn(prompt, completion) -> float`
    for each sample, with `decode(ids) -> str` turning token ids into text (a tokenizer's
    `decode`). The completion holds the sampled tokens up to and with the EOS id."""

    fn: Callable[[str, str], float]
    decode: Callable[[Sequence[int]], str]

    def __post_init__(self):
        wanted = (("fn", 2, "fn(prompt, completion) -> float"), ("decode", 1, "decode(ids) -> str"))
        for name, n, signature in wanted:
            value = getattr(self, name)
            if not callable(value) or takes(value, n) is False:
                raise TypeError(
                    f"HostReward's {name} must be a function {signature}, got "
                    + (f"{_name(value)}{inspect.signature(value)}" if callable(value) else repr(value))
                    + (" (a device reward of (tokens, prompt_lengths, ends) goes to "
                       "make_grpo_step as it is)." if name == "fn" and takes(value, 3) else ".")
                )  # fmt: skip

    def __repr__(self) -> str:
        return f"HostReward(fn={_name(self.fn)}, decode={_name(self.decode)})"


def takes(fn, n: int) -> bool | None:
    """Whether `fn` can be called with `n` positional arguments; `None` when its
    signature cannot be read (some builtins)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(*range(n))
    except TypeError:
        return False
    return True


def _name(fn) -> str:
    """A function's name for a repr (`emits_3`, `Tokenizer.decode`), not its address."""
    if isinstance(fn, HostReward):
        return repr(fn)
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    return name.rsplit("<locals>.", 1)[-1] if isinstance(name, str) else type(fn).__name__


def check_reward(reward):
    """A `HostReward`, or a function of `(tokens, prompt_lengths, ends)`; a function of
    two arguments (text) is told to go in a `HostReward`."""
    if isinstance(reward, HostReward):
        return reward
    if not callable(reward):
        raise TypeError(
            "reward must be a jittable function reward(tokens, prompt_lengths, ends) -> "
            f"(batch, group) float32 rewards, or an eqrope.HostReward; got {reward!r}."
        )
    if takes(reward, 3) is False:
        text = takes(reward, 2)
        raise TypeError(
            f"reward {_name(reward)} does not take (tokens, prompt_lengths, ends), the arrays a "
            "device reward is given"
            + ("; it takes two arguments, as a reward of (prompt, completion) text does: wrap it "
               "as eqrope.HostReward(fn=reward, decode=tokenizer.decode)." if text else
               f"; its signature is {inspect.signature(reward)}.")
        )  # fmt: skip
    return reward


def check_rewards(rewards, batch: int, group: int):
    """The device reward's result, checked at trace time (shape, dtype) and at run time
    (NaN or infinity, through `eqx.error_if`)."""
    shape = getattr(rewards, "shape", None)
    if shape != (batch, group):
        got = f"shape {shape}" if shape is not None else f"{rewards!r} ({type(rewards).__name__})"
        raise ValueError(
            f"the reward must return one number per sample, shape (batch, group) = "
            f"{(batch, group)}, got {got}. A jittable reward returns a float32 array of "
            "that shape."
        )
    if not jnp.issubdtype(rewards.dtype, jnp.floating):
        raise TypeError(
            f"the reward must return floats, got {rewards.dtype}; cast with .astype(jnp.float32)."
        )
    rewards = eqx.error_if(rewards, ~jnp.all(jnp.isfinite(rewards)), "the reward returned a NaN or an infinity.")
    if jnp.finfo(rewards.dtype).max > _FLOAT32_MAX:
        rewards = eqx.error_if(rewards, jnp.any(jnp.abs(rewards) > _FLOAT32_MAX), OUTSIDE_FLOAT32)
    return rewards.astype(jnp.float32)


_FLOAT32_MAX = float(np.finfo(np.float32).max)
OUTSIDE_FLOAT32 = "the reward returned a value outside float32's range (|r| > 3.4e38); rewards are float32."


def host_rewards(reward: HostReward, tokens, prompt_lengths, ends) -> np.ndarray:
    """`reward` of each sample of a rollout, `(batch, group)` float32, checked: the
    prompt is `tokens[i, 0, :prompt_lengths[i]]`, sample `(i, j)`'s completion
    `tokens[i, j, prompt_lengths[i]:ends[i, j]]`, both decoded."""
    tokens, ends, lengths = np.asarray(tokens), np.asarray(ends), np.asarray(prompt_lengths)
    decode = reward.decode
    out = np.zeros(tokens.shape[:2], np.float32)
    for i in range(tokens.shape[0]):
        prompt = decode(tokens[i, 0, : lengths[i]].tolist())
        for j in range(tokens.shape[1]):
            value = reward.fn(prompt, decode(tokens[i, j, lengths[i] : ends[i, j]].tolist()))
            out[i, j] = _host_value(reward, value, i, j)
    return check_host_rewards(out, tokens.shape[:2])

def _host_value(reward: HostReward, value, i: int, j: int):
    """One sample's host reward, checked before it is stored as a float32."""
    value = as_scalar(value)  # a 0-d NumPy or JAX array (`jnp.mean(...)`): its number
    if not is_real(value):
        raise TypeError(f"the host reward must return a number, got {value!r} for sample ({i}, {j}).")
    shown = repr(value) if len(repr(value)) <= 24 else f"an integer of {len(str(abs(value)))} digits"
    said = f"the host reward {_name(reward.fn)} returned {shown} for sample ({i}, {j})"
    if isinstance(value, (float, np.floating)) and not math.isfinite(value):
        raise ValueError(f"{said}: a NaN or an infinity.")
    if abs(value) > _FLOAT32_MAX:  # exact for a Python int of any size
        raise ValueError(f"{said}, outside float32's range (|r| <= 3.4e38); rewards are float32.")
    return value

def check_host_rewards(rewards, shape) -> np.ndarray:
    """Rewards given on the host, checked: shape `(batch, group)`, floats, finite, within
    float32's range; returned as float32."""
    rewards = np.asarray(rewards)
    if rewards.shape != tuple(shape):
        raise ValueError(f"rewards must have shape (batch, group) = {tuple(shape)}, got {rewards.shape}.")
    if not np.issubdtype(rewards.dtype, np.floating):
        raise TypeError(f"rewards must be floats, got {rewards.dtype}.")
    if not np.all(np.isfinite(rewards)):
        raise ValueError("the reward returned a NaN or an infinity.")
    if np.any(np.abs(rewards) > _FLOAT32_MAX):
        outside = rewards[np.abs(rewards) > _FLOAT32_MAX][:3].tolist()
        raise ValueError(f"rewards hold {outside}, outside float32's range (|r| <= 3.4e38); rewards are float32.")
    return rewards.astype(np.float32)
