"""Hugging Face checkpoints out: `eqrope.to_hf`, with numpy and safetensors (no torch).

`_hf_config.py` picks the family and writes `config.json`; `_hf.py` says how the weights
differ (the rotary pairing, the head bias) and `_weights.py` maps them, array by array.
"""

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import safetensors.numpy

from .._checks import check_path
from ._checkpoint import FORMAT as _CHECKPOINT_FORMAT
from ._checkpoint import check_writable, named_arrays
from ._files import swapped_arguments
from ..model._decoder import RotaryDecoder
from ._hf import CONFIG_FILE, INDEX_FILE, SINGLE_FILE
from ._hf_config import hf_config
from .._json import peek_json
from ._table import to_hf as to_hf_arrays


def to_hf(
    model: RotaryDecoder, path: str | os.PathLike, *, drop_head_bias: bool = False
) -> Path:
    """Write `model` as a Hugging Face checkpoint directory of the family that expresses it.

    `transformers.AutoModelForCausalLM.from_pretrained(path)` then gives the same logits,
    and [`eqrope.from_hf`][] gives back the same arrays and config, bit for bit.

    **Arguments:**

    - `model`: a [`eqrope.RotaryDecoder`][] with `norm="rms"`, `mlp="swiglu"` and
      `positions="rope"` (others raise). Its attention options pick the family: q/k norms
      make a Qwen3, q/k/v biases a Qwen2, a sliding window on every block a Mistral,
      anything else a Llama. A model no family expresses raises, saying why.
    - `path`: the directory to write `config.json` and `model.safetensors` into.
    - `drop_head_bias`: these families have no head bias. A zero head bias (as
      initialised) is dropped exactly; a non-zero one raises unless this is `True`, which
      drops it and changes the logits by that bias.

    **Returns:** the directory, as a `Path`.

    Raises, before anything is written: `TypeError` for anything but a `RotaryDecoder`;
    `ValueError` for a model no family expresses, or a non-zero head bias without
    `drop_head_bias`; `NotADirectoryError` for a `path` that is a file; `FileExistsError`
    for a directory holding an eqrope checkpoint or a sharded Hugging Face one; and
    `PermissionError` when this user may not write `path` (or the files it replaces).

    The config has no special tokens (`bos_token_id`, `eos_token_id` are null), since an
    eqrope model has none; set them if your tokenizer has them.
    """
    swapped_arguments("eqrope.to_hf", model, path, model_first=True)
    if not isinstance(model, RotaryDecoder):
        raise TypeError(f"to_hf takes a RotaryDecoder, got {type(model).__name__}.")
    c = model.config
    hf = hf_config(c)  # raises, before anything is written, for what no family expresses
    arrays = {name: np.asarray(a) for name, a in named_arrays(model).items()}
    if "head_bias" in arrays and np.any(arrays["head_bias"] != 0) and not drop_head_bias:
        raise ValueError(
            f"to_hf: the model's head_bias is not zero, and {hf['architectures'][0]} has no "
            "head bias. Pass drop_head_bias=True to write it without (the logits then differ "
            "by the bias), or train with head_bias=False."
        )
    path = check_path(path, "to_hf: path")
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"to_hf: {path} is a file; pass a directory.")
    if (path / INDEX_FILE).exists():
        raise FileExistsError(
            f"to_hf: {path} holds a sharded checkpoint ({INDEX_FILE}) that transformers "
            "would load instead; write into an empty directory."
        )
    if peek_json(path / CONFIG_FILE).get("format") == _CHECKPOINT_FORMAT:
        raise FileExistsError(
            f"to_hf: {path} holds an eqrope checkpoint; refusing to overwrite it. "
            "Write into another directory."
        )
    check_writable(path, "to_hf", beside=False, files=(SINGLE_FILE, CONFIG_FILE))
    path.mkdir(parents=True, exist_ok=True)
    # The head bias, checked above, is dropped: these families have none.
    tensors = to_hf_arrays(arrays, dataclasses.replace(c, head_bias=False))
    safetensors.numpy.save_file(tensors, str(path / SINGLE_FILE), metadata={"format": "pt"})
    (path / CONFIG_FILE).write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    return path


def to_hf_llama(
    model: RotaryDecoder, path: str | os.PathLike, *, drop_head_bias: bool = False
) -> Path:
    """The former name of [`eqrope.to_hf`][], which now writes every supported family;
    kept as an alias."""
    return to_hf(model, path, drop_head_bias=drop_head_bias)
