"""Weights on disk: eqrope's own safetensors checkpoint, and Hugging Face checkpoints in and out.

One table (`_table.py`) names every array; import, export and the sharding rules read it.
"""

from ._checkpoint import load as load, save as save
from ._hf_export import to_hf as to_hf, to_hf_llama as to_hf_llama
from ._hf_import import from_hf as from_hf, from_hf_llama as from_hf_llama
