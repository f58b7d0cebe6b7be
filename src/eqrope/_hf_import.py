"""Hugging Face Llama in: `eqrope.from_hf_llama`, with numpy and safetensors (no torch).

See `_hf.py` for the two differences from Llama it handles (the rotary pairing, the head
bias) and the weight layout.
"""

import os
from pathlib import Path

import numpy as np
import safetensors

from ._checkpoint import compare_to_skeleton, fill, skeleton
from ._checks import check_int
from ._checks import check_bool, check_float
from ._config import DecoderConfig
from ._decoder import RotaryDecoder
from ._hf import CONFIG_FILE, INDEX_FILE, SINGLE_FILE
from ._hf_rope import read_rope, valid as _valid
from ._json import read_json
from ._weights import from_hf, hf_shapes


# Buffers some older checkpoints carry; they are recomputed from the config.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def from_hf_llama(path: str | os.PathLike, *, dtype=None) -> RotaryDecoder:
    """Load a Hugging Face `LlamaForCausalLM` directory as a [`eqrope.RotaryDecoder`][].

    Reads `config.json` and the weights (`model.safetensors`, or the shards listed in
    `model.safetensors.index.json`) with numpy; torch is never imported.

    **Arguments:**

    - `path`: the directory `save_pretrained` wrote.
    - `dtype`: the model's dtype; `None` keeps the dtype of the checkpoint's embedding.

    **Returns:** a decoder with `head_bias=False`, whose logits are those of the Hugging
    Face model. The query and key rows are permuted from rotate-half to interleaved pairing
    (`eqrope._hf.pairing_permutation`; docs/weights.md explains why).

    Config fields that eqrope cannot honour raise a `ValueError` naming the field:
    `attention_bias` or `mlp_bias` true, a `hidden_act` other than `silu`, a `head_dim`
    other than `hidden_size / num_attention_heads`, a `rope_scaling` type other than
    `linear`, `llama3`, `yarn` or `dynamic` (or a key eqrope does not know for its type),
    partial rotary embeddings. So does a field of the wrong type or
    range (`num_attention_heads: 0`, `hidden_size: "32"`, `rope_theta: null`), and a shard
    in the index that lies outside `path` (absolute, `..`, or a symlink out of it).
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(
            f"from_hf_llama: no directory at {path}; pass the directory that "
            "LlamaForCausalLM.save_pretrained wrote (config.json + *.safetensors)."
        )
    config_file = path / CONFIG_FILE
    if not config_file.is_file():
        raise FileNotFoundError(
            f"from_hf_llama: {config_file} is missing; a Hugging Face model directory has one."
        )
    hf = read_json(config_file, "from_hf_llama")
    # The config is checked before any weights are read; the dtype comes from them.
    dtype_name = "float32" if dtype is None else np.dtype(dtype).name
    config = decoder_config(hf, str(config_file), dtype_name)
    tensors = _read_tensors(path)
    embed_name = "model.embed_tokens.weight"
    if embed_name not in tensors:
        raise ValueError(
            f"from_hf_llama: the weights in {path} have no {embed_name!r}; "
            "is this a LlamaForCausalLM?"
        )
    if dtype is None:
        config = decoder_config(hf, str(config_file), np.dtype(tensors[embed_name].dtype).name)
    _check_tensors(tensors, config, path)
    arrays = from_hf(tensors, config)
    expected = skeleton(config)
    problems = compare_to_skeleton(arrays, expected)
    if problems:  # a bug in this converter, not in the user's files
        raise AssertionError(
            "from_hf_llama built arrays that do not fit the decoder: " + "; ".join(problems)
        )
    return fill(expected, arrays)


def decoder_config(hf: dict, source: str, dtype_name: str) -> DecoderConfig:
    """The [`eqrope.DecoderConfig`][] of a Hugging Face Llama `config.json` dict.

    Every field read is checked for its type and range; a bad one raises a `ValueError`
    naming the field and `source`.
    """

    def need(name):
        if name not in hf or hf[name] is None:
            raise ValueError(
                f"from_hf_llama: {source} has no field {name!r}; a Llama config needs it."
            )
        return hf[name]

    def size(name, value=None):
        return _valid(check_int, need(name) if value is None else value, name, source, minimum=1)

    def refuse(name, why):
        raise ValueError(
            f"from_hf_llama: {source} has {name}={hf.get(name)!r}, which eqrope cannot "
            f"honour: {why}"
        )

    if hf.get("model_type", "llama") != "llama":
        refuse("model_type", "only 'llama' checkpoints (LlamaForCausalLM) are supported.")
    if hf.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "eqrope's SwiGLU gates with silu, as Llama does.")
    for name in ("attention_bias", "mlp_bias"):
        if _valid(check_bool, hf.get(name, False), name, source):
            refuse(name, "eqrope's Llama-style decoder has no projection biases (bias=False).")
    d_model, n_heads = size("hidden_size"), size("num_attention_heads")
    if d_model % n_heads != 0:
        refuse("num_attention_heads", f"it does not divide hidden_size={d_model}.")
    if hf.get("head_dim") is not None and size("head_dim") != d_model // n_heads:
        refuse(
            "head_dim",
            f"eqrope uses head_dim = hidden_size / num_attention_heads = {d_model // n_heads}.",
        )
    n_kv_heads = hf.get("num_key_value_heads")
    max_len = size("max_position_embeddings")
    rope = read_rope(hf, source, max_len)
    try:
        return DecoderConfig(
            vocab_size=size("vocab_size"),
            d_model=d_model,
            n_heads=n_heads,
            n_blocks=size("num_hidden_layers"),
            max_len=max_len,
            d_ff=size("intermediate_size"),
            n_kv_heads=n_heads if n_kv_heads is None else size("num_key_value_heads"),
            **rope,
            norm_eps=_valid(check_float, hf.get("rms_norm_eps", 1e-6), "rms_norm_eps", source),
            head_bias=False,
            tie_embeddings=_valid(
                check_bool, hf.get("tie_word_embeddings", False), "tie_word_embeddings", source
            ),
            dtype=dtype_name,
        )
    except ValueError as e:
        raise ValueError(
            f"from_hf_llama: {source} does not give a valid eqrope config: {e}"
        ) from None


def _check_tensors(tensors: dict, c: DecoderConfig, path: Path) -> None:
    """Raise, listing every problem, unless `tensors` are the Llama tensors `c` implies."""
    shapes = hf_shapes(c)
    names = {n for n in tensors if not n.endswith(_IGNORED_SUFFIXES)}
    if c.tie_embeddings and "lm_head.weight" in names:
        # Some tied checkpoints store the head anyway; it must be the embedding.
        if not np.array_equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"]):
            raise ValueError(
                f"from_hf_llama: config.json in {path} sets tie_word_embeddings=true but "
                "lm_head.weight differs from model.embed_tokens.weight; fix the config."
            )
        names.discard("lm_head.weight")
    problems = [f"missing tensor {n!r}" for n in shapes if n not in names]
    problems += [f"unexpected tensor {n!r}" for n in sorted(names - set(shapes))]
    problems += [
        f"tensor {n!r} has shape {tuple(tensors[n].shape)}, config.json implies {s}"
        for n, s in shapes.items()
        if n in names and tuple(tensors[n].shape) != s
    ]
    problems += [
        f"tensor {n!r} has dtype {tensors[n].dtype}, not a floating dtype"
        for n in shapes
        if n in names and not _is_float(tensors[n].dtype)
    ]
    if problems:
        raise ValueError(
            f"from_hf_llama: the weights in {path} do not match its config.json:\n  "
            + "\n  ".join(problems)
            + "\nIs this an unmodified LlamaForCausalLM checkpoint?"
        )


def _is_float(dtype) -> bool:
    return np.issubdtype(dtype, np.floating) or np.dtype(dtype).name == "bfloat16"


def _read_tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint, from the sharded index if there is one."""
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index, "from_hf_llama").get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"from_hf_llama: {index} has no 'weight_map' object.")
        by_file: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            _check_shard(path, name, shard)
            by_file.setdefault(shard, []).append(name)
    elif (path / SINGLE_FILE).is_file():
        by_file = {SINGLE_FILE: None}
    else:
        raise FileNotFoundError(
            f"from_hf_llama: {path} has neither {SINGLE_FILE} nor {INDEX_FILE}; save the "
            "model with save_pretrained(..., safe_serialization=True) (no .bin/pickle files)."
        )
    tensors = {}
    for shard, names in by_file.items():
        file = path / shard
        if not file.is_file():
            raise FileNotFoundError(
                f"from_hf_llama: shard {file} listed in {INDEX_FILE} is missing."
            )
        try:
            with safetensors.safe_open(str(file), framework="numpy") as f:
                present = set(f.keys())
                wanted = present if names is None else names
                absent = sorted(set(wanted) - present)
                if absent:
                    raise ValueError(
                        f"from_hf_llama: {INDEX_FILE} puts {absent[:3]} in {file}, which "
                        "lacks them."
                    )
                for name in wanted:
                    tensors[name] = f.get_tensor(name)
        except ValueError:
            raise
        except Exception as e:  # safetensors' own errors for a damaged file
            raise ValueError(
                f"from_hf_llama: {file} is truncated or corrupted ({type(e).__name__}: {e})."
            ) from None
    return tensors


def _check_shard(path: Path, name: str, shard) -> None:
    """Refuse an index entry whose file is not inside `path`: not absolute, no `..` out of
    it, and no symlink out of it, except into the `blobs/` of a Hugging Face hub cache
    (`<repo>/snapshots/<revision>/` holds links to `<repo>/blobs/`)."""
    where = f"from_hf_llama: {path / INDEX_FILE} maps {name!r} to {shard!r}"
    if not isinstance(shard, str) or not shard:
        raise ValueError(f"{where}, which is not a file name.")
    root = path.resolve()
    allowed = [root]
    if root.parent.name == "snapshots":
        allowed.append(root.parent.parent / "blobs")
    lexical = Path(os.path.normpath(root / shard))
    real = (path / shard).resolve()
    if not lexical.is_relative_to(root) or not any(real.is_relative_to(a) for a in allowed):
        raise ValueError(
            f"{where}, which is outside the checkpoint directory (it resolves to {real}); "
            "refusing to read it. Shards must be files inside the directory."
        )
