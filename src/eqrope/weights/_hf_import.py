"""Hugging Face checkpoints in: `eqrope.from_hf`, with numpy and safetensors (no torch).

`_hf_config.py` reads `config.json` (one family at a time); `_hf.py` says how the weights
differ (the rotary pairing, the head bias) and `_table.py` maps them, array by array.
The tensors are checked from the files' headers, then streamed (`_stream.py`): each array
of the model is allocated once and filled tensor by tensor, so loading holds about the
checkpoint's size, in its dtype unless `dtype` converts.
"""

import dataclasses
import os
from pathlib import Path

import jax
import numpy as np

from ._checkpoint import compare_to_skeleton, fill, skeleton
from .._checks import check_int, check_path, not_local
from .._custom_types import IntLike
from ..model._config import _DTYPES, DecoderConfig
from ..model._decoder import RotaryDecoder, check_layout
from ..model._layouts import decoding_layout
from ._hf import CONFIG_FILE, INDEX_FILE, SINGLE_FILE
from ._hf_config import ARCHITECTURES, decoder_config
from .._json import read_json
from .._log import warn
from ._stream import Reader, Tensor, read_header, to_device
from ._table import from_hf as from_hf_arrays, hf_shapes


# Buffers some older checkpoints carry; they are recomputed from the config.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def from_hf(
    path: str | os.PathLike, *, dtype=None, max_len: IntLike | None = None, layout: str | None = None
) -> RotaryDecoder:
    """Load a Hugging Face checkpoint directory as a [`eqrope.RotaryDecoder`][].

    Reads `config.json` and the weights (`model.safetensors`, or the shards listed in
    `model.safetensors.index.json`) with numpy; torch is never imported. Where both are
    present (two `save_pretrained` calls into one folder), `model.safetensors` is read,
    as transformers reads it, with a warning. The family comes from `config.json`'s
    `model_type`: `llama` (Llama 2/3.x, SmolLM, TinyLlama), `mistral`, `qwen2` (Qwen2,
    Qwen2.5) or `qwen3`; [`eqrope.AttentionOptions`][] says what each adds.

    **Arguments:**

    - `path`: the directory `save_pretrained` wrote (or a hub snapshot); `~` is expanded.
      eqrope does not download: a hub id (`"HuggingFaceTB/SmolLM2-135M"`) or a missing
      path raises a `FileNotFoundError` that says how to download it, and a file (its
      `model.safetensors`) one that names its folder.
    - `dtype`: the model's dtype, one of `"float32"`, `"bfloat16"`, `"float16"`,
      `"float64"` (with `jax_enable_x64`) or the matching NumPy/JAX dtype; `None` keeps
      the checkpoint's (bfloat16 stays bfloat16; norms, softmax and rotary angles compute
      in float32 whatever it is). `"float32"` converts.
    - `max_len`: the model's `max_len`, that is the longest cache
      [`eqrope.generate`][] and `init_cache` may allocate; `None` means the config's
      `max_position_embeddings`, which bounds it. [`eqrope.generate`][] sizes each call's
      cache to the call whatever it is.
    - `layout`: `"unstacked"` (one buffer per block, which every `generate` call reads
      in place), `"stacked"` (blocks on a leading axis, for a training loop that scans
      over them; a `generate` call then slices a float32 model's blocks into a
      per-call copy), or `None` (the default): the decoding layout of the model's
      dtype, unstacked, or stacked for bfloat16 and float16 on the CPU, which are read
      in place either way and compile faster stacked. See docs/kv_cache.md, "Which
      layout when".

    **Returns:** a decoder with `head_bias=False`, whose logits are those of the Hugging
    Face model. The query and key rows are permuted from rotate-half to interleaved pairing
    (`eqrope.weights._hf.pairing_permutation`; docs/weights.md explains why).

    A key `config.json` leaves out takes the default of the family's transformers config
    class, as transformers reads the file (a Mistral without `sliding_window` has a window
    of 4096, a Qwen3 without `head_dim` heads of 128).

    Config fields that eqrope cannot honour raise a `ValueError` naming the field: an
    unknown `model_type`, a `hidden_act` other than `silu`, `mlp_bias` without
    `attention_bias`, a `rope_scaling` type other than `linear`, `llama3`, `yarn` or
    `dynamic` (or a key eqrope does not know for its type), partial rotary embeddings. So
    does a field of the wrong type or range, under its key in `config.json`
    (`num_attention_heads: 0`, `hidden_size: "32"`, `rope_theta: null`, `rms_norm_eps:
    -1e-6`, a `num_key_value_heads` that does not divide `num_attention_heads`, an odd
    head width, a llama3 `high_freq_factor` not above `low_freq_factor`), a missing or
    misshapen tensor, a tensor of integers (named, `model.embed_tokens.weight` included),
    and a shard in the index that lies outside `path` (absolute, `..`, or a symlink out of
    it). A `dtype` eqrope models cannot hold (`"int8"`, `"bogus"`) raises a `ValueError`
    naming `dtype` and the choices.
    """
    given, path = path, check_path(path, "from_hf: path")
    if not path.exists():
        raise FileNotFoundError(f"from_hf: no directory at {path}: {not_local(given)}")
    if not path.is_dir():
        raise FileNotFoundError(
            f"from_hf: {path} is a file, not a directory; pass its folder, {str(path.parent)!r}: "
            "the directory that save_pretrained wrote (config.json + *.safetensors)."
        )
    config_file = path / CONFIG_FILE
    if not config_file.is_file():
        raise FileNotFoundError(
            f"from_hf: {config_file} is missing; a Hugging Face model directory has one."
        )
    hf = read_json(config_file, "from_hf")
    max_len = check_int(max_len, "max_len", minimum=1, none=True)
    if layout is not None:
        check_layout(layout, "from_hf: layout")
    dtype_name = _model_dtype(
        dtype, f"from_hf: dtype={dtype!r}", "Pass dtype= one of them (a name or a NumPy/JAX "
        "dtype), or None for the checkpoint's."
    )
    # The config is checked before any weights are read; without `dtype`, the dtype comes
    # from them, once they are checked (float32 until then: the shapes do not depend on it).
    config = decoder_config(hf, str(config_file), dtype_name or "float32", max_len)
    tensors = _read_tensors(path)
    embed_name = "model.embed_tokens.weight"
    if embed_name not in tensors:
        raise ValueError(
            f"from_hf: the weights in {path} have no {embed_name!r}; is this a "
            f"{hf.get('model_type')} causal language model?"
        )
    with Reader() as reader:
        _check_tensors(tensors, config, path, hf["model_type"], reader)
        if dtype_name is None:
            kept = tensors[embed_name].dtype.name
            dtype_name = _model_dtype(
                kept,
                f"from_hf: tensor {embed_name!r} in {path} is {kept}, and dtype=None keeps the "
                "checkpoint's dtype",
                "Pass dtype= one of them to convert, e.g. dtype='float32'.",
            )
            config = dataclasses.replace(config, dtype=dtype_name)
        layout = decoding_layout(config.dtype) if layout is None else layout

        def copy(name, out, **how):
            reader.copy(tensors[name], out, **how)

        # One array at a time: read into its final buffer, then JAX's (the same memory).
        arrays = {name: to_device(a) for name, a in from_hf_arrays(copy, config, layout)}
    expected = skeleton(config, layout)
    problems = compare_to_skeleton(arrays, expected)
    if problems:  # a bug in this converter, not in the user's files
        raise AssertionError(
            "from_hf built arrays that do not fit the decoder: " + "; ".join(problems)
        )
    return fill(expected, arrays)


def from_hf_llama(path: str | os.PathLike, *, dtype=None, max_len: IntLike | None = None) -> RotaryDecoder:
    """The former name of [`eqrope.from_hf`][], which now reads every supported family;
    kept as an alias."""
    return from_hf(path, dtype=dtype, max_len=max_len)


def _check_tensors(
    tensors: dict[str, Tensor], c: DecoderConfig, path: Path, family: str, reader: Reader
) -> None:
    """Raise, listing every problem, unless `tensors` are the tensors `c` implies (their
    names, shapes and dtypes, from the files' headers)."""
    shapes = hf_shapes(c)
    names = {n for n in tensors if not n.endswith(_IGNORED_SUFFIXES)}
    if c.tie_embeddings and "lm_head.weight" in names:
        # Some tied checkpoints store the head anyway; it must be the embedding.
        if not reader.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"]):
            raise ValueError(
                f"from_hf: config.json in {path} sets tie_word_embeddings=true but "
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
            f"from_hf: the weights in {path} do not match its config.json:\n  "
            + "\n  ".join(problems)
            + f"\nIs this an unmodified {ARCHITECTURES[family]} checkpoint?"
        )


def _model_dtype(dtype, what: str, fix: str) -> str | None:
    """The name of `dtype` if an eqrope model can hold it (`None` stays `None`); else a
    `ValueError` that starts with `what` (who gave it) and ends with `fix`."""
    if dtype is None:
        return None
    try:
        name = np.dtype(dtype).name
    except (TypeError, ValueError):
        name = None
    if name not in _DTYPES:
        raise ValueError(
            f"{what}: eqrope models hold one of {', '.join(_DTYPES)} (float64 with "
            f"jax_enable_x64). {fix}"
        )
    if name == "float64" and jax.dtypes.canonicalize_dtype(np.float64) != np.float64:
        others = ", ".join(n for n in _DTYPES if n != "float64")
        raise ValueError(
            f"{what}: float64 needs jax_enable_x64, which is off (every array would silently "
            f"be float32); call jax.config.update('jax_enable_x64', True) first, or use one of "
            f"{others}. {fix}"
        )
    return name


def _is_float(dtype) -> bool:
    return np.issubdtype(dtype, np.floating) or np.dtype(dtype).name == "bfloat16"


def _read_tensors(path: Path) -> dict[str, Tensor]:
    """Every tensor of the checkpoint (where it is, no data read): `model.safetensors` if
    there is one, else the shards the index lists.

    transformers reads `model.safetensors` first too (`_get_resolved_checkpoint_files`),
    and two saves into one folder leave both: `save_pretrained(d, max_shard_size=...)`
    then `save_pretrained(d)` writes `model.safetensors` and deletes the shards, but not
    the index. A warning names the index that is ignored."""
    index = path / INDEX_FILE
    by_file: dict[str, list[str] | None] = {}
    if (path / SINGLE_FILE).is_file():
        by_file[SINGLE_FILE] = None
        if index.is_file():
            warn(
                f"from_hf: {path} holds both {SINGLE_FILE} and {INDEX_FILE}; reading "
                f"{SINGLE_FILE}, as transformers does. Two save_pretrained calls into one "
                "folder leave both. Delete the stale one: the index if the last save wrote "
                f"{SINGLE_FILE}, or {SINGLE_FILE} if it wrote shards (they are then read).",
                UserWarning,
            )
    elif index.is_file():
        weight_map = read_json(index, "from_hf").get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"from_hf: {index} has no 'weight_map' object.")
        shards: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            _check_shard(path, name, shard)
            shards.setdefault(shard, []).append(name)
        by_file.update(shards)
    else:
        raise FileNotFoundError(
            f"from_hf: {path} has neither {SINGLE_FILE} nor {INDEX_FILE}; save the "
            "model with save_pretrained(..., safe_serialization=True) (no .bin/pickle files)."
        )
    tensors = {}
    for shard, names in by_file.items():
        file = path / shard
        if not file.is_file():
            raise FileNotFoundError(
                f"from_hf: shard {file} listed in {INDEX_FILE} is missing."
            )
        try:
            _, present = read_header(file)
        except Exception as e:  # safetensors' own errors for a damaged file
            raise ValueError(
                f"from_hf: {file} is truncated or corrupted ({type(e).__name__}: {e})."
            ) from None
        wanted = present if names is None else names
        absent = sorted(set(wanted) - set(present))
        if absent:
            raise ValueError(
                f"from_hf: {INDEX_FILE} puts {absent[:3]} in {file}, which lacks them."
            )
        tensors.update((name, present[name]) for name in wanted)
    return tensors


def _check_shard(path: Path, name: str, shard) -> None:
    """Refuse an index entry whose file is not inside `path`: not absolute, no `..` out of
    it, and no symlink out of it, except into the `blobs/` of a Hugging Face hub cache
    (`<repo>/snapshots/<revision>/` holds links to `<repo>/blobs/`)."""
    where = f"from_hf: {path / INDEX_FILE} maps {name!r} to {shard!r}"
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
