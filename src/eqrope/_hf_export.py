"""Hugging Face Llama out: `eqrope.to_hf_llama`, with numpy and safetensors (no torch).

See `_hf.py` for the two differences from Llama it handles (the rotary pairing, the head
bias) and the weight layout.
"""

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import safetensors.numpy

from ._checkpoint import FORMAT as _CHECKPOINT_FORMAT
from ._checkpoint import named_arrays
from ._config import DecoderConfig
from ._decoder import RotaryDecoder
from ._hf import CONFIG_FILE, INDEX_FILE, SINGLE_FILE
from ._hf_rope import write_rope
from ._json import peek_json
from ._weights import to_hf


def to_hf_llama(
    model: RotaryDecoder, path: str | os.PathLike, *, drop_head_bias: bool = False
) -> Path:
    """Write `model` as a Hugging Face `LlamaForCausalLM` directory.

    `transformers.LlamaForCausalLM.from_pretrained(path)` then gives the same logits.

    **Arguments:**

    - `model`: a [`eqrope.RotaryDecoder`][] with the Llama architecture: `norm="rms"`,
      `mlp="swiglu"`, `bias=False`, `positions="rope"` (others raise).
    - `path`: the directory to write `config.json` and `model.safetensors` into.
    - `drop_head_bias`: Llama has no head bias. A zero head bias (as initialised) is
      dropped exactly; a non-zero one raises unless this is `True`, which drops it and
      changes the logits by that bias.

    **Returns:** the directory, as a `Path`.

    The config has no special tokens (`bos_token_id`, `eos_token_id` are null), since an
    eqrope model has none; set them if your tokenizer has them.
    """
    if not isinstance(model, RotaryDecoder):
        raise TypeError(f"to_hf_llama takes a RotaryDecoder, got {type(model).__name__}.")
    c = model.config
    wanted = {
        "norm": ("rms", "Llama normalises with RMSNorm"),
        "mlp": ("swiglu", "Llama's feed-forward layer is SwiGLU"),
        "bias": (False, "Llama's projections have no biases"),
        "positions": ("rope", "Llama has rotary positions, not a learned table"),
    }
    for field, (value, why) in wanted.items():
        if getattr(c, field) != value:
            raise ValueError(
                f"to_hf_llama: the model has {field}={getattr(c, field)!r}; {why}, so it cannot be "
                f"written as LlamaForCausalLM. Only models with {field}={value!r} can."
            )
    arrays = {name: np.asarray(a) for name, a in named_arrays(model).items()}
    if "head_bias" in arrays and np.any(arrays["head_bias"] != 0) and not drop_head_bias:
        raise ValueError(
            "to_hf_llama: the model's head_bias is not zero, and LlamaForCausalLM has no head "
            "bias. Pass drop_head_bias=True to write it without (the logits then differ by "
            "the bias), or train with head_bias=False."
        )
    hf = hf_config(c)  # raises, before anything is written, for a scaling it cannot express
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"to_hf_llama: {path} is a file; pass a directory.")
    if (path / INDEX_FILE).exists():
        raise FileExistsError(
            f"to_hf_llama: {path} holds a sharded checkpoint ({INDEX_FILE}) that transformers "
            "would load instead; write into an empty directory."
        )
    if peek_json(path / CONFIG_FILE).get("format") == _CHECKPOINT_FORMAT:
        raise FileExistsError(
            f"to_hf_llama: {path} holds an eqrope checkpoint; refusing to overwrite it. "
            "Write into another directory."
        )
    path.mkdir(parents=True, exist_ok=True)
    # The head bias, checked above, is dropped: Llama has none.
    tensors = to_hf(arrays, dataclasses.replace(c, head_bias=False))
    safetensors.numpy.save_file(tensors, str(path / SINGLE_FILE), metadata={"format": "pt"})
    (path / CONFIG_FILE).write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    return path


def hf_config(c: DecoderConfig) -> dict:
    """The Hugging Face `LlamaConfig` dict of a Llama-shaped [`eqrope.DecoderConfig`][]."""
    rope = write_rope(c)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.d_model,
        "intermediate_size": c.d_ff,
        "num_hidden_layers": c.n_blocks,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.head_dim,
        "max_position_embeddings": c.max_len,
        "hidden_act": "silu",
        "rms_norm_eps": c.norm_eps,
        # transformers >= 5 reads `rope_parameters`; older versions `rope_theta`/`rope_scaling`.
        "rope_parameters": rope,
        "rope_theta": c.rope_base,
        "rope_scaling": None if c.rope_scaling is None else rope,
        "tie_word_embeddings": c.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "dtype": c.dtype,
    }
