"""eqrope: a rotary decoder-only transformer with a static key/value cache, in JAX + Equinox."""

from ._attention import CausalSelfAttention as CausalSelfAttention
from ._attention_options import AttentionOptions as AttentionOptions
from ._block import DecoderBlock as DecoderBlock
from ._cache import KVCache as KVCache, cache_nbytes as cache_nbytes
from ._checkpoint import load as load, save as save
from ._config import DecoderConfig as DecoderConfig, RopeScaling as RopeScaling
from ._decoder import RotaryDecoder as RotaryDecoder
from ._generate import Generation as Generation, generate as generate
from ._generation_config import GenerationConfig as GenerationConfig
from ._hf_export import to_hf as to_hf, to_hf_llama as to_hf_llama
from ._hf_import import from_hf as from_hf, from_hf_llama as from_hf_llama
from ._mesh import make_mesh as make_mesh
from ._mlp import GeluMLP as GeluMLP, SwiGLU as SwiGLU
from ._params import count_params as count_params
from ._prompt_lookup import PromptLookup as PromptLookup
from ._rope import apply_rope as apply_rope, rope_inv_freq as rope_inv_freq
from ._sharding import (
    ShardingRules as ShardingRules,
    shard as shard,
    shard_batch as shard_batch,
    shardings as shardings,
)
from ._text import generate_text as generate_text
from ._tokenizer import Tokenizer as Tokenizer
from ._train import (
    cross_entropy as cross_entropy,
    init_optimizer as init_optimizer,
    make_train_step as make_train_step,
)

__version__ = "0.1.0"
