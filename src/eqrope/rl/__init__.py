"""Reinforcement learning on the model's own samples: GRPO's objective (advantages, the
clipped ratio, the KL term) and the step that rolls out, rewards and updates.
"""

from ._objective import (
    group_advantages as group_advantages,
    grpo_objective as grpo_objective,
    rollout_logprobs as rollout_logprobs,
)
from ._rewards import HostReward as HostReward
from ._step import (
    GRPOStep as GRPOStep,
    Rollout as Rollout,
    make_grpo_step as make_grpo_step,
)
