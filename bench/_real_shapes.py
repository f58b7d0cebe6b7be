"""bench/vs_transformers.py --only real: transformers' models of the shapes in `_shapes.py`.

The sizes are `_shapes.py`'s, copied from each model's published `config.json` (random
weights: nothing is downloaded). transformers builds each model with its own config and model classes in
float32, `save_pretrained` writes it, and `eqrope.from_hf` reads it back, so both sides
hold the same weights. Needs torch and transformers (the `[hf]` extra); imported by
bench/vs_transformers.py after it has checked that they are installed.
"""

import pathlib

import numpy as np
import torch
import transformers

import eqrope
from _memory import peak_growth
from _roofline import copy_bandwidth, weight_nbytes
from _shapes import QWEN25_05B, SMOLLM2_135M


# name: (family, fields, the hub repository the fields come from)
SHAPES = {
    "smollm2_135m": ("llama", SMOLLM2_135M, "HuggingFaceTB/SmolLM2-135M"),
    "qwen2.5_0.5b": ("qwen2", QWEN25_05B, "Qwen/Qwen2.5-0.5B"),
}
CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}
# The memory check's checkpoint: the SmolLM2-135M shape built for 131072 positions.
MEMORY_SHAPE = "smollm2_135m"
MEMORY_MAX_POSITIONS = 131072


def fields_of(name: str, tiny: bool) -> dict:
    """The published fields of shape `name`; with `tiny`, the same heads and kv heads at
    head_dim 8, 2 layers, a vocabulary of 256 and d_ff 32 (a smoke run)."""
    fields = dict(SHAPES[name][1])
    if tiny:
        fields.update(vocab_size=256, hidden_size=8 * fields["num_attention_heads"],
                      intermediate_size=32, num_hidden_layers=2, max_position_embeddings=256)
    return fields


def hf_model(family: str, fields: dict, dtype, seed: int = 0):
    """transformers' model of `family` with its initial random weights (seeded), biases
    drawn like the weights (they start at zero), in `dtype`; no BOS, EOS or pad id, so
    that `generate` runs every row to `max_new_tokens`."""
    config_cls, model_cls = (getattr(transformers, n) for n in CLASSES[family])
    config = config_cls(**fields, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, config.initializer_range)
    return model.to(dtype)


def build_pair(name: str, tiny: bool, directory: pathlib.Path):
    """transformers' float32 model of shape `name`, and eqrope's reading of its checkpoint."""
    family = SHAPES[name][0]
    theirs = hf_model(family, fields_of(name, tiny), torch.float32)
    theirs.save_pretrained(directory, safe_serialization=True)
    ours = eqrope.from_hf(directory)
    return ours, theirs


def prompts(vocab_size: int, batch: int, length: int, seed: int = 0) -> np.ndarray:
    """`batch` different prompts of `length` random ids (no padding needed)."""
    return np.random.default_rng(seed).integers(0, vocab_size, (batch, length), dtype=np.int64)


def copy_rate(cfg: dict) -> dict:
    """The DRAM copy rate of the roofline: `_roofline.copy_bandwidth` (numpy, one thread,
    best of `copy_repeats`), the convention of the issue's figure (27 GB/s)."""
    return copy_bandwidth(cfg["copy_mb"] * 2**20, cfg["copy_repeats"])


def roofline(model, row: dict, copy: dict, xla_pass: dict) -> dict:
    """Batch 1: the per-token time of eqrope against weight bytes over the copy rates."""
    weights = weight_nbytes(model)
    per_token = row["eqrope"]["median_s"] / row["new_tokens"]
    floor = weights / copy["bytes_per_s"]
    xla_floor = weights / xla_pass["bytes_per_s"]
    return {
        "weights_nbytes": weights,
        "per_token_s": per_token,
        "per_token_fastest_s": row["eqrope"]["min_s"] / row["new_tokens"],
        "roofline_per_token_s": floor,
        "fraction": floor / per_token,
        "copy": copy,
        "xla_pass_roofline_per_token_s": xla_floor,
        "fraction_of_xla_pass": xla_floor / per_token,
        "xla_pass": xla_pass,
        "convention": (
            "per_token_s = eqrope's median call time / new_tokens (the prompt's prefill and "
            "the call's overhead included); roofline_per_token_s = weights_nbytes / "
            "copy.bytes_per_s (every weight read once per token, the cache rows not "
            "counted; numpy copyto, one thread, best of its repeats, measured just before "
            "the batch-1 timings); fraction = roofline / measured (1 = at the roofline). "
            "xla_pass: the same with bench/_bounds.py's in-place XLA pass over a DRAM-sized "
            "buffer (all cores), timed in rounds with the batch-1 calls"
        ),
    }


def memory_check(cfg: dict, directory: pathlib.Path) -> dict:
    """A bfloat16 checkpoint of the SmolLM2-135M shape with max_position_embeddings
    131072, and the peak RSS growth of a short `generate` on it, in a fresh process."""
    fields = {**fields_of(MEMORY_SHAPE, cfg["real_tiny"]),
              "max_position_embeddings": MEMORY_MAX_POSITIONS}
    model = hf_model(SHAPES[MEMORY_SHAPE][0], fields, torch.bfloat16, seed=1)
    model.save_pretrained(directory, safe_serialization=True)
    del model
    record = peak_growth(directory, cfg["memory_prompt"], cfg["memory_new"])
    record["shape"] = MEMORY_SHAPE
    record["hf_config"] = fields
    record["checkpoint"] = "a temporary directory (removed)"
    return record
