"""Adapters on disk: the `A` and `B` arrays alone, bound to the base model's config.

An adapter directory holds two files:

- `eqrope_adapter.json`: `{"format": "eqrope-adapter", "format_version": 1, "adapter":
  {rank, alpha, targets, dropout, rslora}, "base_config": {...}}`, the base being
  `model.config.to_dict()`;
- `adapter.safetensors`: each adapter array by name (`"blocks.attn.wqkv.q.a"`, blocks
  stacked), with a SHA-256 of each array and of the JSON object in its metadata, as
  [`eqrope.save`][] writes a checkpoint.

They are written atomically (a new directory beside the target, renamed into place), and
[`eqrope.load_adapter`][] refuses an adapter whose base config differs from the model's,
naming the fields. The file names differ from PEFT's, which `_peft.py` reads and
writes.
"""

import json
import os
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import safetensors
import safetensors.numpy

from .._checks import check_path
from .._json import read_json
from ..model._config import DecoderConfig
from ..model._decoder import RotaryDecoder
from ..weights._checkpoint import _config_digest, _digest, _write_directory, check_writable
from ._lora import check_adapted, check_base, lora
from ._targets import places
from ._weight import lora_weights


FORMAT = "eqrope-adapter"
FORMAT_VERSION = 1
CONFIG_FILE = "eqrope_adapter.json"
ARRAYS_FILE = "adapter.safetensors"
_HASH = "sha256:"
_CONFIG_HASH = "config_sha256"


# -- the arrays and settings of an adapted model, shared with the PEFT converter --------------


def adapter_settings(model: RotaryDecoder, who: str) -> dict:
    """`{rank, alpha, targets, dropout, rslora}` of an adapted model, the keywords of
    [`eqrope.lora`][] that rebuild its shapes; a `ValueError` if its adapters differ
    (several ranks, or stacked adapters)."""
    check_adapted(model, who)
    blocks = model.layout == "stacked"
    found, targets = set(), []
    for w in lora_weights(model):
        if w.rows is not None:
            raise ValueError(f"{who}: the model's adapters are chosen per row; take one first.")
        for name, p in zip(w.names, w.parts):
            if p is None:
                continue
            if p.a.ndim != 2 + blocks:
                raise ValueError(
                    f"{who}: the model stacks several adapters; take one with "
                    "eqrope.take_adapter first."
                )
            found.add((p.rank, p.alpha, p.dropout, p.rslora))
            targets.append(name)
    if len(found) != 1:
        raise ValueError(
            f"{who}: the adapters differ in rank, alpha, dropout or rslora ({sorted(found)}); "
            "eqrope writes adapters whose targets share them."
        )
    rank, alpha, dropout, rslora = found.pop()
    targets = tuple(dict.fromkeys(targets))
    return dict(rank=rank, alpha=alpha, targets=targets, dropout=dropout, rslora=rslora)


def adapter_arrays(model: RotaryDecoder) -> dict:
    """Each adapter array of `model` by name, `"{path}.{target}.a"` and `.b`, with the
    blocks stacked: `a (blocks, d_in, rank)`, `b (blocks, rank, d_part)`."""
    out = {}
    for w in lora_weights(model):  # an unstacked model's: block by block, in order
        for name, p in zip(w.names, w.parts):
            if p is not None:
                out.setdefault(f"{w.path}.{name}.a", []).append(p.a)
                out.setdefault(f"{w.path}.{name}.b", []).append(p.b)
    stack = model.layout == "unstacked"  # only the adapters' arrays, not the base's
    return {k: jnp.stack(v) if stack else v[0] for k, v in out.items()}


def with_adapter_arrays(model: RotaryDecoder, settings: dict, arrays: dict) -> RotaryDecoder:
    """`model` (a base) adapted with `settings` and the given `arrays` (checked already
    against `expected_arrays`), in `model`'s layout."""
    adapted = lora(model, **settings, key=jax.random.PRNGKey(0))  # the base's own arrays
    for path in dict.fromkeys(w.path for w in lora_weights(adapted)):
        for where, block in places(adapted, path):  # the stack, or each block's own
            w = where(adapted)
            take = (lambda x: x) if block is None else (lambda x, i=block: x[i])
            parts = tuple(
                None if p is None else eqx.tree_at(
                    lambda p: (p.a, p.b), p, tuple(take(jnp.asarray(arrays[f"{path}.{name}.{x}"])) for x in "ab")
                )
                for name, p in zip(w.names, w.parts)
            )  # fmt: skip
            adapted = eqx.tree_at(where, adapted, eqx.tree_at(lambda w: w.parts, w, parts))
    return adapted


def expected_arrays(model: RotaryDecoder, settings: dict) -> dict:
    """The shape and dtype of each adapter array `with_adapter_arrays` takes."""
    skeleton = eqx.filter_eval_shape(
        lambda m: lora(m.stacked(), **settings, key=jax.random.PRNGKey(0)), model
    )
    return adapter_arrays(skeleton)


def config_differences(saved: dict, config: DecoderConfig) -> list[str]:
    """The fields where a saved base config differs from `config`, one line each."""
    ours = json.loads(json.dumps(config.to_dict()))
    keys = sorted(set(saved) | set(ours))
    return [f"{k}: {saved.get(k)!r} (saved) vs {ours.get(k)!r} (this model)" for k in keys if saved.get(k) != ours.get(k)]


# -- save and load ----------------------------------------------------------------------------


def save_adapter(path: str | os.PathLike, model: RotaryDecoder) -> Path:
    """Write the adapters of `model` (from [`eqrope.lora`][], [`eqrope.from_peft`][] or
    training) to the directory `path`, without the base.

    The directory holds `eqrope_adapter.json` (the adapter's settings and the base's
    config) and `adapter.safetensors` (the `A` and `B` arrays, with checksums), written
    atomically: a save that fails leaves an earlier one as it was. Other files in the
    directory are kept.

    **Returns:** the directory, as a `Path`.
    """
    settings = adapter_settings(model, "eqrope.save_adapter")
    path = check_path(path, "eqrope.save_adapter: path")
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"eqrope.save_adapter: {path} is a file; pass a directory.")
    record = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "adapter": {**settings, "targets": list(settings["targets"])},
        "base_config": model.config.to_dict(),
    }
    text = json.dumps(record, indent=2, sort_keys=True, allow_nan=False) + "\n"
    host = {n: np.ascontiguousarray(np.asarray(a)) for n, a in adapter_arrays(model).items()}
    metadata = {"format": FORMAT, _CONFIG_HASH: _config_digest(record)}
    metadata.update({_HASH + n: _digest(a) for n, a in host.items()})
    files = {ARRAYS_FILE: safetensors.numpy.save(host, metadata=metadata), CONFIG_FILE: text.encode()}
    check_writable(path, "eqrope.save_adapter", beside=True)
    _write_directory(path, files)
    return path


def load_adapter(model: RotaryDecoder, path: str | os.PathLike) -> RotaryDecoder:
    """`model` with the adapters [`eqrope.save_adapter`][] wrote to `path`.

    **Arguments:** `model`, the base (a [`eqrope.RotaryDecoder`][] without adapters, of
    the config the adapters were saved with; either layout, kept), and `path`, the
    directory.

    Raises `FileNotFoundError` for a missing file, and `ValueError` for an adapter saved
    for another base (naming the config fields that differ), a damaged file (a checksum
    that does not match, arrays from another save, a JSON file without its `"adapter"`
    record or one of its keys, named with the file) or arrays that do not fit.
    """
    check_base(model, "eqrope.load_adapter")
    path = check_path(path, "eqrope.load_adapter: path")
    config_file, arrays_file = path / CONFIG_FILE, path / ARRAYS_FILE
    for f in (config_file, arrays_file):
        if not f.is_file():
            raise FileNotFoundError(
                f"eqrope.load_adapter: {f} is missing; pass the directory eqrope.save_adapter "
                "wrote (for a PEFT adapter directory use eqrope.from_peft)."
            )
    record = read_json(config_file, "eqrope.load_adapter")
    if record.get("format") != FORMAT or record.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"eqrope.load_adapter: {config_file} is not an eqrope adapter of format version "
            f"{FORMAT_VERSION} (format {record.get('format')!r}, version "
            f"{record.get('format_version')!r})."
        )
    differences = config_differences(record.get("base_config") or {}, model.config)
    if differences:
        raise ValueError(
            f"eqrope.load_adapter: the adapter at {path} was saved for another base model; "
            "its config differs from this model's:\n  " + "\n  ".join(differences)
            + "\nLoad it onto the base it was trained on."
        )
    settings = _settings_record(record, config_file)
    try:
        with safetensors.safe_open(str(arrays_file), framework="numpy") as f:
            metadata = f.metadata() or {}
            arrays = {n: f.get_tensor(n) for n in f.keys()}
    except Exception as e:  # safetensors' own errors for a damaged header
        raise ValueError(f"eqrope.load_adapter: {arrays_file} is damaged ({type(e).__name__}: {e}).") from None
    problems = [f"array {n!r} does not match its checksum" for n, a in arrays.items() if metadata.get(_HASH + n) != _digest(a)]
    if metadata.get(_CONFIG_HASH) != _config_digest(record):
        problems.append(f"the arrays were saved with another {CONFIG_FILE}")
    problems += compare_arrays(arrays, expected_arrays(model, settings))
    if problems:
        raise ValueError(
            f"eqrope.load_adapter: {path} is damaged or mixed from different saves:\n  "
            + "\n  ".join(problems) + "\nRestore both files from one eqrope.save_adapter."
        )
    return with_adapter_arrays(model, settings, arrays)


_SETTINGS = ("rank", "alpha", "targets", "dropout", "rslora")
_RESTORE = "Restore the file eqrope.save_adapter wrote."


def _settings_record(record: dict, config_file: Path) -> dict:
    """The `"adapter"` record of an adapter's JSON, the keywords of `lora`; a
    `ValueError` naming the file and the key when it, or one of its keys, is missing."""
    settings = record.get("adapter")
    if not isinstance(settings, dict):
        found = "missing" if settings is None else f"a {type(settings).__name__}, not an object"
        raise ValueError(
            f"eqrope.load_adapter: {config_file} has no \"adapter\" record ({found}); it holds "
            f"the adapter's settings {{{', '.join(_SETTINGS)}}}. {_RESTORE}"
        )
    missing = [k for k in _SETTINGS if k not in settings]
    unknown = sorted(set(settings) - set(_SETTINGS))
    if missing or unknown:
        raise ValueError(
            f"eqrope.load_adapter: {config_file}: the \"adapter\" record "
            + (f"lacks {', '.join(map(repr, missing))}" if missing else f"has unknown keys {unknown}")
            + f"; it holds exactly {', '.join(_SETTINGS)}. {_RESTORE}"
        )
    if not isinstance(settings["targets"], list):
        raise ValueError(
            f"eqrope.load_adapter: {config_file}: \"adapter\".\"targets\" must be a list of "
            f"target names, got {settings['targets']!r}."
        )
    return {**settings, "targets": tuple(settings["targets"])}


def compare_arrays(arrays: dict, expected: dict, name=lambda n: repr(n)) -> list[str]:
    """Missing, unexpected, reshaped and retyped arrays, one line each (`name` shows a key)."""
    problems = [f"missing array {name(n)}" for n in expected if n not in arrays]
    problems += [f"unexpected array {name(n)}" for n in arrays if n not in expected]
    for n, s in expected.items():
        if n in arrays and tuple(arrays[n].shape) != tuple(s.shape):
            problems.append(f"array {name(n)} has shape {tuple(arrays[n].shape)}, the base needs {tuple(s.shape)}")
        elif n in arrays and np.dtype(arrays[n].dtype) != np.dtype(s.dtype):
            problems.append(f"array {name(n)} has dtype {np.dtype(arrays[n].dtype)}, the base needs {np.dtype(s.dtype)}")
    return problems
