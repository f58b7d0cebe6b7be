"""Training: the next-token loss, the optimizer state and the compiled optax train step.

Remat comes from the model's config (`remat=True`); the block scan stays stacked here.
"""

from ._loss import cross_entropy as cross_entropy
from ._step import init_optimizer as init_optimizer, make_train_step as make_train_step
from ._lora import (
    LoraWeight as LoraWeight,
    LowRank as LowRank,
    base_model as base_model,
    lora as lora,
    merge as merge,
    unmerge as unmerge,
)
from ._lora_io import load_adapter as load_adapter, save_adapter as save_adapter
from ._lora_many import (
    adapter_axes as adapter_axes,
    select_adapters as select_adapters,
    stack_adapters as stack_adapters,
    take_adapter as take_adapter,
)
from ._lora_peft import from_peft as from_peft, to_peft as to_peft
from ._lora_step import (
    init_adapter_optimizer as init_adapter_optimizer,
    make_adapter_train_step as make_adapter_train_step,
)
from ._lora_shard import adapter_shardings as adapter_shardings
from ._grpo import (
    group_advantages as group_advantages,
    grpo_objective as grpo_objective,
    rollout_logprobs as rollout_logprobs,
)
from ._grpo_step import (
    GRPOStep as GRPOStep,
    HostReward as HostReward,
    Rollout as Rollout,
    make_grpo_step as make_grpo_step,
)
