"""Low-rank adapters (LoRA): the adapted weight, adapting and merging, adapter files and
PEFT's format, many adapters in one program, their shardings and the adapter train step.
"""

from ._weight import LoraWeight as LoraWeight, LowRank as LowRank
from ._lora import base_model as base_model, lora as lora, merge as merge, unmerge as unmerge
from ._io import load_adapter as load_adapter, save_adapter as save_adapter
from ._many import (
    adapter_axes as adapter_axes,
    select_adapters as select_adapters,
    stack_adapters as stack_adapters,
    take_adapter as take_adapter,
)
from ._peft import from_peft as from_peft, to_peft as to_peft
from ._step import (
    AdapterTrainStep as AdapterTrainStep,
    init_adapter_optimizer as init_adapter_optimizer,
    make_adapter_train_step as make_adapter_train_step,
)
from ._shard import adapter_shardings as adapter_shardings
