"""The rotary decoder: its configuration, layers, blocks and key/value cache.

Everything here is an `eqx.Module` or a frozen config; nothing imports from the other folders.
"""

from ._attention import CausalSelfAttention as CausalSelfAttention
from ._attention_options import AttentionOptions as AttentionOptions
from ._block import DecoderBlock as DecoderBlock
from ._cache import KVCache as KVCache, cache_nbytes as cache_nbytes
from ._config import DecoderConfig as DecoderConfig, RopeScaling as RopeScaling
from ._decoder import RotaryDecoder as RotaryDecoder
from ._mlp import GeluMLP as GeluMLP, SwiGLU as SwiGLU
from ._params import count_params as count_params
from ._rope import apply_rope as apply_rope, rope_inv_freq as rope_inv_freq
