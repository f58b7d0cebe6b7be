"""Checkpoints: a directory with the config as JSON and the arrays in safetensors.

A checkpoint is two files in one directory:

- `config.json`: `{"format": "eqrope-checkpoint", "format_version": 2, "config": {...}}`,
  the config being `model.config.to_dict()`;
- `model.safetensors`: every array of the model, keyed by its pytree path
  (`"embed"`, `"blocks.attn.wqkv"`, `"final_norm.weight"`, ...), with a SHA-256 of each
  array in the file's metadata, since safetensors itself has no checksum, and (from
  version 2) the SHA-256 of the config, which binds the two files together.

Saving serialises everything first, writes a new directory beside the target and renames
it into place, so a failed save leaves the old checkpoint as it was (`_files.py`). Loading
rebuilds the model's skeleton from the config without computing anything
(`eqx.filter_eval_shape`), checks the arrays' names, shapes and dtypes and the config's
hash against it from the file's header, then reads each array into the buffer the model
keeps (`_stream.py`), checking its checksum as it goes; a bad checkpoint raises and never
gives a half-loaded model, and loading holds about the file's size. Nothing is pickled.
Version 1 (no config hash) is still read.
"""

import hashlib
import json
import os
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import safetensors.numpy

from .._checks import check_path
from ..model._config import DecoderConfig
from ..model._decoder import RotaryDecoder, check_layout
from ..model._layouts import decoding_layout
from ._files import _write_directory, check_writable, swapped_arguments
from .._json import peek_json, read_json
from ._stream import Reader, Tensor, empty, read_header, to_device
from ._table import unstacked_name


FORMAT = "eqrope-checkpoint"
FORMAT_VERSION = 2
CONFIG_FILE = "config.json"
ARRAYS_FILE = "model.safetensors"
_HASH_PREFIX = "sha256:"
_CONFIG_HASH = "config_sha256"


def save(path: str | os.PathLike, model: RotaryDecoder) -> Path:
    """Write `model` to the directory `path` (created if needed) as a checkpoint.

    **Arguments:**

    - `path`: a directory (created if needed). An earlier eqrope checkpoint there is
      replaced, other files in it are kept; a directory with any other `config.json` (say
      a Hugging Face model's), or with a `model.safetensors` but no `config.json`, is left
      alone and the call raises.
    - `model`: a [`eqrope.RotaryDecoder`][].

    **Returns:** the directory, as a `Path`.

    Everything is checked and serialised before anything is written; the files go into a
    new directory beside `path`, which is then renamed to `path`. A save that fails at any
    point leaves an earlier checkpoint at `path` as it was.

    Raises `TypeError` for anything but a `RotaryDecoder`; `ValueError` for a model whose
    arrays do not fit its own config; `NotADirectoryError` for a `path` that is a file;
    `FileExistsError` for a directory that holds another kind of `config.json`, or a
    `model.safetensors` without one; and `PermissionError`, before anything is written,
    when this user may not write `path` or the folder that holds it (the rename needs
    both).
    """
    swapped_arguments("eqrope.save", model, path, model_first=False)
    if not isinstance(model, RotaryDecoder):
        raise TypeError(
            f"eqrope.save takes a RotaryDecoder, got {type(model).__name__}; "
            "save other pytrees with eqx.tree_serialise_leaves."
        )
    path = check_path(path, "eqrope.save: path")
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(
            f"eqrope.save: {path} is a file; a checkpoint is a directory, pass a directory path."
        )
    arrays = named_arrays(model)
    problems = compare_to_skeleton(arrays, skeleton(model.config))
    if problems:
        raise ValueError(
            "eqrope.save: the model's arrays do not match its own config, so the checkpoint "
            "could not be loaded again:\n  " + "\n  ".join(problems) + "\nRebuild the model "
            "with RotaryDecoder.from_config, or change arrays only with eqx.tree_at keeping "
            "their shapes and dtypes."
        )
    config = {"format": FORMAT, "format_version": FORMAT_VERSION, "config": model.config.to_dict()}
    config_text = json.dumps(config, indent=2, sort_keys=True, allow_nan=False) + "\n"
    host = {name: np.ascontiguousarray(np.asarray(a)) for name, a in arrays.items()}
    metadata = {"format": FORMAT, "format_version": str(FORMAT_VERSION)}
    metadata[_CONFIG_HASH] = _config_digest(config)
    metadata.update({_HASH_PREFIX + name: _digest(a) for name, a in host.items()})
    arrays_bytes = safetensors.numpy.save(host, metadata=metadata)
    files = {ARRAYS_FILE: arrays_bytes, CONFIG_FILE: config_text.encode()}
    if path.is_dir():
        _check_replaceable(path)
    check_writable(path, "eqrope.save", beside=True)
    _write_directory(path, files)
    return path


def load(path: str | os.PathLike, *, layout: str | None = None) -> RotaryDecoder:
    """Read a checkpoint written by [`eqrope.save`][].

    **Arguments:**

    - `path`: the checkpoint directory.
    - `layout`: `"unstacked"` (one buffer per block, which `generate` reads in
      place), `"stacked"` (for a training loop that scans over blocks), or `None` (the
      default: the decoding layout of the model's dtype), as for [`eqrope.from_hf`][];
      the file holds the stacked layout either way.

    **Returns:** the [`eqrope.RotaryDecoder`][], bitwise equal to the one saved.

    Raises `FileNotFoundError` for a missing directory or file and `ValueError` for a
    damaged file (bad JSON, truncated safetensors, a checksum that does not match), an
    invalid config, or a config that does not match the arrays (a missing, extra,
    reshaped or retyped array, or arrays saved with another config).
    """
    if layout is not None:
        check_layout(layout, "load: layout")
    path = check_path(path, "eqrope.load: path")
    if not path.is_dir():
        hint = (
            f" Pass the directory {path.parent} instead of the file."
            if path.name in (CONFIG_FILE, ARRAYS_FILE)
            else " Pass the directory eqrope.save wrote."
        )
        raise FileNotFoundError(f"eqrope.load: no checkpoint directory at {path}.{hint}")
    config_file, arrays_file = path / CONFIG_FILE, path / ARRAYS_FILE
    config, version, digest = _read_config(config_file)
    layout = decoding_layout(config.dtype) if layout is None else layout
    stored, metadata = _read_header(arrays_file)
    bound = metadata.get(_CONFIG_HASH)
    problems = compare_to_skeleton(stored, skeleton(config))
    if bound is None and version >= 2:
        problems.append(f"{arrays_file} has no SHA-256 of its config (format_version {version})")
    elif bound is not None and bound != digest:
        problems.append(
            f"the arrays were saved with a config whose SHA-256 is {bound[:16]}..., "
            f"the SHA-256 of this config is {digest[:16]}...: they come from different saves"
        )
    with Reader() as reader:
        if problems:  # a damaged file is named first, as when everything fits
            for t in stored.values():
                _read_checked(reader, t, metadata, _scratch(t))
            raise ValueError(
                f"eqrope.load: {config_file} and {arrays_file} do not belong together:\n  "
                + "\n  ".join(problems) + "\nThe config says which arrays the model has; "
                "restore the matching pair of files (both from the same eqrope.save)."
            )
        # One array at a time: read into its final buffer, then JAX's (the same memory).
        arrays = {name: to_device(a) for name, a in _read_arrays(reader, stored, metadata, layout)}
    return fill(skeleton(config, layout), arrays)


# -- pieces shared with the Hugging Face converter --------------------------------------


def skeleton(config: DecoderConfig, layout: str = "stacked") -> RotaryDecoder:
    """The decoder for `config` in `layout` with `jax.ShapeDtypeStruct` leaves: shapes,
    no compute."""
    def build():
        return RotaryDecoder.from_config(config, key=jax.random.PRNGKey(0)).with_layout(layout)

    return eqx.filter_eval_shape(build)


def named_arrays(model: RotaryDecoder) -> dict[str, jax.Array | jax.ShapeDtypeStruct | np.ndarray]:
    """Every array leaf of `model` by its pytree path, e.g. `"blocks.attn.wqkv"`; an
    unstacked model's blocks are stacked first (checkpoints hold the stacked layout)."""
    if isinstance(model, RotaryDecoder):
        model = model.stacked()
    out = {}
    # A module standing where a weight array stands (an adapter's `LoraWeight`, whose
    # `x @ W` is its own) is a leaf here, so that it is refused by name.
    wrapped = lambda x: isinstance(x, eqx.Module) and hasattr(type(x), "__rmatmul__")  # noqa: E731
    for path, leaf in jax.tree_util.tree_flatten_with_path(model, is_leaf=wrapped)[0]:
        name = _path_name(path)
        if wrapped(leaf):
            raise TypeError(
                f"model field {name!r} holds a {type(leaf).__name__} (an adapted weight), "
                "not an array; merge the adapters into the weights first "
                "(eqrope.merge(model)), or save the adapters alone (eqrope.save_adapter)."
            )
        if not isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct, np.ndarray)):
            raise TypeError(
                f"model field {name!r} holds a {type(leaf).__name__}, not an array; "
                "checkpoints hold arrays only (hyperparameters live in the config)."
            )
        out[name] = leaf
    return out


def compare_to_skeleton(arrays: dict, expected: RotaryDecoder) -> list[str]:
    """Every difference between `arrays` and the skeleton, one line each (empty: none);
    the arrays by the skeleton's leaf names, in its layout."""
    wanted = _leaves(expected)
    problems = [
        f"missing array {name!r} {_describe(s)}" for name, s in wanted.items() if name not in arrays
    ]
    problems += [
        f"unexpected array {name!r} {_describe(a)}: the config has no such field"
        for name, a in arrays.items()
        if name not in wanted
    ]
    for name, s in wanted.items():
        if name not in arrays:
            continue
        a = arrays[name]
        if tuple(a.shape) != tuple(s.shape):
            problems.append(
                f"array {name!r} has shape {tuple(a.shape)}, the config needs {tuple(s.shape)}"
            )
        elif np.dtype(a.dtype) != np.dtype(s.dtype):
            problems.append(
                f"array {name!r} has dtype {np.dtype(a.dtype)}, "
                f"the config needs {np.dtype(s.dtype)}"
            )
    return problems


def fill(expected: RotaryDecoder, arrays: dict[str, jax.Array]) -> RotaryDecoder:
    """The skeleton `expected` with each leaf replaced by `arrays[its path]` (JAX arrays,
    already checked), as they are."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(expected)
    values = [arrays[_path_name(path)] for path, _ in leaves]
    return jax.tree_util.tree_unflatten(treedef, values)


# -- private helpers -------------------------------------------------------------------


def _path_name(path) -> str:
    parts = []
    for entry in path:
        for attr in ("name", "key", "idx"):
            if hasattr(entry, attr):
                parts.append(str(getattr(entry, attr)))
                break
        else:
            parts.append(str(entry))
    return ".".join(parts)


def _leaves(tree) -> dict:
    """The leaves of `tree` by their path names, in its layout."""
    return {_path_name(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _describe(a) -> str:
    return f"(shape {tuple(a.shape)}, dtype {np.dtype(a.dtype)})"


def _digest(a: np.ndarray) -> str:
    """SHA-256 of the bytes of `a` (read in place when it is contiguous)."""
    return hashlib.sha256(np.ascontiguousarray(a).reshape(-1).view(np.uint8)).hexdigest()


def _config_digest(data: dict) -> str:
    """SHA-256 of the config file's object, in a canonical form (whitespace-free)."""
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def _check_replaceable(path: Path) -> None:
    config_path = path / CONFIG_FILE
    if config_path.exists() and peek_json(config_path).get("format") != FORMAT:
        raise FileExistsError(
            f"eqrope.save: {config_path} exists and is not an eqrope checkpoint's config; "
            "refusing to overwrite it. Save into an empty directory."
        )
    if not config_path.exists() and (path / ARRAYS_FILE).exists():
        raise FileExistsError(
            f"eqrope.save: {path / ARRAYS_FILE} exists without an eqrope {CONFIG_FILE}; "
            "refusing to overwrite it. Save into an empty directory."
        )


def _read_config(file: Path) -> tuple[DecoderConfig, int, str]:
    if not file.is_file():
        raise FileNotFoundError(
            f"eqrope.load: {file} is missing; a checkpoint needs {CONFIG_FILE} and "
            f"{ARRAYS_FILE} side by side, as eqrope.save writes them."
        )
    data = read_json(
        file, "eqrope.load", "The file is damaged; restore it from the same eqrope.save as the arrays."
    )
    if data.get("format") != FORMAT:
        raise ValueError(
            f"eqrope.load: {file} has format {data.get('format')!r}, not {FORMAT!r}; it was not "
            f"written by eqrope.save. For a Hugging Face directory use "
            f"eqrope.from_hf({str(file.parent)!r})."
        )
    version = data.get("format_version")
    if type(version) is not int or not 1 <= version <= FORMAT_VERSION:
        raise ValueError(
            f"eqrope.load: {file} has format_version {version!r}; this eqrope reads versions "
            f"1..{FORMAT_VERSION}. Upgrade eqrope to read newer checkpoints."
        )
    if not isinstance(data.get("config"), dict):
        raise ValueError(f"eqrope.load: {file} has no 'config' object; the file is damaged.")
    try:
        config = DecoderConfig.from_dict(data["config"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"eqrope.load: the 'config' in {file} is invalid: {e}") from None
    return config, version, _config_digest(data)


def _read_header(file: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The arrays of `file` (where they are, no data read) and its metadata, every array
    with a checksum there."""
    if not file.is_file():
        raise FileNotFoundError(
            f"eqrope.load: {file} is missing; a checkpoint needs {CONFIG_FILE} and "
            f"{ARRAYS_FILE} side by side, as eqrope.save writes them."
        )
    try:
        metadata, stored = read_header(file)
    except Exception as e:  # safetensors raises its own error types for a damaged header
        raise ValueError(
            f"eqrope.load: {file} is truncated or corrupted and cannot be read "
            f"({type(e).__name__}: {e}). Restore it from the same eqrope.save as {CONFIG_FILE}."
        ) from None
    for name in stored:
        if _HASH_PREFIX + name not in metadata:
            raise ValueError(
                f"eqrope.load: {file} has no checksum for array {name!r}; it was not written "
                "by eqrope.save (or its header was damaged)."
            )
    return stored, metadata


def _read_arrays(reader: Reader, stored: dict[str, Tensor], metadata: dict, layout: str):
    """Each array, checked against its checksum, as `(leaf name, array)` of the decoder
    in `layout` (stacked in the file, an unstacked decoder's blocks one per block)."""
    for name, t in stored.items():
        if layout == "unstacked" and name.startswith("blocks."):
            blocks = [empty(t.shape[1:], t.dtype) for _ in range(t.shape[0])]
            _read_checked(reader, t, metadata, blocks)
            yield from ((unstacked_name(name, i), a) for i, a in enumerate(blocks))
        else:
            whole = empty(t.shape, t.dtype)
            _read_checked(reader, t, metadata, [whole])
            yield name, whole


def _read_checked(reader: Reader, t: Tensor, metadata: dict, outs) -> None:
    """The bytes of `t` into `outs` (contiguous arrays that take them in order), or a
    `ValueError` if they do not match the checksum in `metadata`."""
    hasher, offset = hashlib.sha256(), 0
    for out in outs:
        reader.read_into(t, out, offset, hasher)
        offset += out.nbytes
    if hasher.hexdigest() != metadata[_HASH_PREFIX + t.name]:
        raise ValueError(
            f"eqrope.load: array {t.name!r} in {t.file} does not match its checksum; the file "
            f"is corrupted. Restore it from the same eqrope.save as {CONFIG_FILE}."
        )


def _scratch(t: Tensor, chunk: int = 2**20):
    """One reused buffer over the bytes of `t`, chunk after chunk (to check, not to keep)."""
    buffer = empty((min(chunk, t.nbytes),), np.uint8)
    return (buffer[: min(chunk, t.nbytes - at)] for at in range(0, t.nbytes, chunk))
