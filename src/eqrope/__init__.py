"""eqrope: a rotary decoder-only transformer with a static key/value cache, in JAX + Equinox.

The public API is `eqrope.NAME`; the folders group it by concern: `model`, `generation`,
`text`, `structured`, `weights`, `training`, `adapters`, `rl`, `sharding`, `eval` and `serving`.
"""

from ._compilation_cache import use_compilation_cache as use_compilation_cache
from ._log import enable_logging as enable_logging
from .eval import Scores as Scores, score as score
from .generation import (
    Generation as Generation,
    GenerationConfig as GenerationConfig,
    PromptLookup as PromptLookup,
    StopStrings as StopStrings,
    TruncationWarning as TruncationWarning,
    generate as generate,
)
from .model import (
    AttentionOptions as AttentionOptions,
    CausalSelfAttention as CausalSelfAttention,
    DecoderBlock as DecoderBlock,
    DecoderConfig as DecoderConfig,
    GeluMLP as GeluMLP,
    KVCache as KVCache,
    RopeScaling as RopeScaling,
    RotaryDecoder as RotaryDecoder,
    SwiGLU as SwiGLU,
    apply_rope as apply_rope,
    cache_nbytes as cache_nbytes,
    count_params as count_params,
    rope_inv_freq as rope_inv_freq,
)
from .adapters import (
    LoraWeight as LoraWeight,
    LowRank as LowRank,
    adapter_axes as adapter_axes,
    adapter_shardings as adapter_shardings,
    base_model as base_model,
    from_peft as from_peft,
    init_adapter_optimizer as init_adapter_optimizer,
    load_adapter as load_adapter,
    lora as lora,
    make_adapter_train_step as make_adapter_train_step,
    merge as merge,
    save_adapter as save_adapter,
    select_adapters as select_adapters,
    stack_adapters as stack_adapters,
    take_adapter as take_adapter,
    to_peft as to_peft,
    unmerge as unmerge,
)
from .rl import (
    GRPOStep as GRPOStep,
    HostReward as HostReward,
    Rollout as Rollout,
    group_advantages as group_advantages,
    grpo_objective as grpo_objective,
    make_grpo_step as make_grpo_step,
    rollout_logprobs as rollout_logprobs,
)
from .serving import (
    Completion as Completion,
    Engine as Engine,
    EngineStats as EngineStats,
    Event as Event,
)
from .sharding import (
    ShardingRules as ShardingRules,
    make_mesh as make_mesh,
    shard as shard,
    shard_batch as shard_batch,
    shardings as shardings,
)
from .structured import Choice as Choice, JsonSchema as JsonSchema, Regex as Regex
from .text import TextGeneration as TextGeneration, Tokenizer as Tokenizer, generate_text as generate_text
from .training import (
    cross_entropy as cross_entropy,
    init_optimizer as init_optimizer,
    make_train_step as make_train_step,
)
from .weights import (
    from_hf as from_hf,
    from_hf_llama as from_hf_llama,
    load as load,
    save as save,
    to_hf as to_hf,
    to_hf_llama as to_hf_llama,
)

__version__ = "0.1.0"
