"""Checkpoints: a directory with the config as JSON and the arrays in safetensors.

A checkpoint is two files in one directory:

- `config.json`: `{"format": "eqrope-checkpoint", "format_version": 1, "config": {...}}`,
  the config being `model.config.to_dict()`;
- `model.safetensors`: every array of the model, keyed by its pytree path
  (`"embed"`, `"blocks.attn.wqkv"`, `"final_norm.weight"`, ...), with a SHA-256 of each
  array in the file's metadata, since safetensors itself has no checksum.

Loading rebuilds the model's skeleton from the config without computing anything
(`eqx.filter_eval_shape`), checks every array against it (names, shapes, dtypes,
checksums) and only then fills it in, so a bad checkpoint raises and never gives a
half-loaded model. Nothing is pickled: safetensors holds raw bytes, JSON holds the rest.
"""

import hashlib
import json
import os
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import safetensors
import safetensors.numpy

from ._config import DecoderConfig
from ._decoder import RotaryDecoder
from ._json import peek_json, read_json


FORMAT = "eqrope-checkpoint"
FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
ARRAYS_FILE = "model.safetensors"
_HASH_PREFIX = "sha256:"


def save(path: str | os.PathLike, model: RotaryDecoder) -> Path:
    """Write `model` to the directory `path` (created if needed) as a checkpoint.

    **Arguments:**

    - `path`: a directory. Its `config.json` and `model.safetensors` are replaced if they
      belong to an earlier eqrope checkpoint; any other `config.json` (say a Hugging Face
      model's) is left alone and the call raises.
    - `model`: a [`eqrope.RotaryDecoder`][].

    **Returns:** the directory, as a `Path`.

    Each file is written under a temporary name and renamed into place, so an interrupted
    save does not leave a truncated file under the final name.
    """
    if not isinstance(model, RotaryDecoder):
        raise TypeError(
            f"eqrope.save takes a RotaryDecoder, got {type(model).__name__}; "
            "save other pytrees with eqx.tree_serialise_leaves."
        )
    path = Path(path)
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
    path.mkdir(parents=True, exist_ok=True)
    config_path = path / CONFIG_FILE
    if config_path.exists() and peek_json(config_path).get("format") != FORMAT:
        raise FileExistsError(
            f"eqrope.save: {config_path} exists and is not an eqrope checkpoint's config; "
            "refusing to overwrite it. Save into an empty directory."
        )
    host = {name: np.ascontiguousarray(np.asarray(a)) for name, a in arrays.items()}
    metadata = {"format": FORMAT, "format_version": str(FORMAT_VERSION)}
    metadata.update({_HASH_PREFIX + name: _digest(a) for name, a in host.items()})
    config = {"format": FORMAT, "format_version": FORMAT_VERSION, "config": model.config.to_dict()}
    _write_atomic(path / ARRAYS_FILE, safetensors.numpy.save(host, metadata=metadata))
    _write_atomic(config_path, (json.dumps(config, indent=2, sort_keys=True) + "\n").encode())
    return path


def load(path: str | os.PathLike) -> RotaryDecoder:
    """Read a checkpoint written by [`eqrope.save`][].

    **Arguments:**

    - `path`: the checkpoint directory.

    **Returns:** the [`eqrope.RotaryDecoder`][], bitwise equal to the one saved.

    Raises `FileNotFoundError` for a missing directory or file and `ValueError` for a
    damaged file (bad JSON, truncated safetensors, a checksum that does not match) or a
    config that does not match the arrays (a missing, extra, reshaped or retyped array).
    """
    path = Path(path)
    if not path.is_dir():
        hint = (
            f" Pass the directory {path.parent} instead of the file."
            if path.name in (CONFIG_FILE, ARRAYS_FILE)
            else " Pass the directory eqrope.save wrote."
        )
        raise FileNotFoundError(f"eqrope.load: no checkpoint directory at {path}.{hint}")
    config = _read_config(path / CONFIG_FILE)
    arrays = _read_arrays(path / ARRAYS_FILE)
    expected = skeleton(config)
    problems = compare_to_skeleton(arrays, expected)
    if problems:
        raise ValueError(
            f"eqrope.load: {path / CONFIG_FILE} and {path / ARRAYS_FILE} do not belong "
            "together:\n  " + "\n  ".join(problems) + "\nThe config says which arrays the "
            "model has; restore the matching pair of files (both from the same eqrope.save)."
        )
    return fill(expected, arrays)


# -- pieces shared with the Hugging Face converter --------------------------------------


def skeleton(config: DecoderConfig) -> RotaryDecoder:
    """The decoder for `config` with `jax.ShapeDtypeStruct` leaves: shapes, no compute."""
    return eqx.filter_eval_shape(RotaryDecoder.from_config, config, key=jax.random.PRNGKey(0))


def named_arrays(model: RotaryDecoder) -> dict[str, jax.Array | jax.ShapeDtypeStruct | np.ndarray]:
    """Every array leaf of `model` by its pytree path, e.g. `"blocks.attn.wqkv"`."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(model)[0]:
        name = _path_name(path)
        if not isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct, np.ndarray)):
            raise TypeError(
                f"model field {name!r} holds a {type(leaf).__name__}, not an array; "
                "checkpoints hold arrays only (hyperparameters live in the config)."
            )
        out[name] = leaf
    return out


def compare_to_skeleton(arrays: dict, expected: RotaryDecoder) -> list[str]:
    """Every difference between `arrays` and the skeleton, one line each (empty: none)."""
    wanted = named_arrays(expected)
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


def fill(expected: RotaryDecoder, arrays: dict) -> RotaryDecoder:
    """The skeleton `expected` with each leaf replaced by `arrays[its path]` (already checked)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(expected)
    values = [jnp.asarray(arrays[_path_name(path)]) for path, _ in leaves]
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


def _describe(a) -> str:
    return f"(shape {tuple(a.shape)}, dtype {np.dtype(a.dtype)})"


def _digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def _write_atomic(target: Path, data: bytes) -> None:
    tmp = target.with_name(target.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)


def _read_config(file: Path) -> DecoderConfig:
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
            "written by eqrope.save. For a Hugging Face directory use eqrope.from_hf_llama."
        )
    version = data.get("format_version")
    if not isinstance(version, int) or not 1 <= version <= FORMAT_VERSION:
        raise ValueError(
            f"eqrope.load: {file} has format_version {version!r}; this eqrope reads versions "
            f"1..{FORMAT_VERSION}. Upgrade eqrope to read newer checkpoints."
        )
    if not isinstance(data.get("config"), dict):
        raise ValueError(f"eqrope.load: {file} has no 'config' object; the file is damaged.")
    try:
        return DecoderConfig.from_dict(data["config"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"eqrope.load: the 'config' in {file} is invalid: {e}") from None


def _read_arrays(file: Path) -> dict[str, np.ndarray]:
    if not file.is_file():
        raise FileNotFoundError(
            f"eqrope.load: {file} is missing; a checkpoint needs {CONFIG_FILE} and "
            f"{ARRAYS_FILE} side by side, as eqrope.save writes them."
        )
    try:
        with safetensors.safe_open(str(file), framework="numpy") as f:
            metadata = f.metadata() or {}
            arrays = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as e:  # safetensors raises its own error types for a damaged header
        raise ValueError(
            f"eqrope.load: {file} is truncated or corrupted and cannot be read "
            f"({type(e).__name__}: {e}). Restore it from the same eqrope.save as {CONFIG_FILE}."
        ) from None
    for name, a in arrays.items():
        stored = metadata.get(_HASH_PREFIX + name)
        if stored is None:
            raise ValueError(
                f"eqrope.load: {file} has no checksum for array {name!r}; it was not written "
                "by eqrope.save (or its header was damaged)."
            )
        if stored != _digest(a):
            raise ValueError(
                f"eqrope.load: array {name!r} in {file} does not match its checksum; the file "
                f"is corrupted. Restore it from the same eqrope.save as {CONFIG_FILE}."
            )
    return arrays
