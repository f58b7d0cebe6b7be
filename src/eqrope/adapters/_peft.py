"""PEFT's LoRA adapters in and out: `adapter_config.json` and `adapter_model.safetensors`.

With numpy and safetensors only; neither peft nor torch is imported. PEFT names each
tensor after the Hugging Face module it adapts,
`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` `(rank, d_in)` and
`...lora_B.weight` `(d_out, rank)`, and scales the update by `lora_alpha / r` (or
`lora_alpha / sqrt(r)` with `use_rslora`), as eqrope does. The conversion transposes
(`nn.Linear` stores `(out, in)`) and permutes the rows of the q and k updates' `B` from
rotate-half to interleaved pairing, as `from_hf` permutes the q and k weights.

What eqrope's adapters cannot express is refused by name: DoRA, bias training,
`modules_to_save`, a target module the model does not have, adapters on some blocks
only, per-module ranks, and any other LoraConfig field set to something but its default.
"""

import json
import os
import re
from pathlib import Path

import numpy as np
import safetensors
import safetensors.numpy

from .._checks import check_bool, check_float, check_int, check_path
from .._json import checked, read_json
from ..model._config import DecoderConfig
from ..model._decoder import RotaryDecoder
from ..weights._checkpoint import _write_directory, check_writable
from ..weights._hf import pairing_permutation
from ._lora import check_base
from ._targets import ALL_TARGETS, TARGETS
from ._io import adapter_arrays, adapter_settings, compare_arrays, expected_arrays, with_adapter_arrays


CONFIG_FILE = "adapter_config.json"
ARRAYS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
# LoraConfig fields that change nothing eqrope computes (bookkeeping, or initialisation
# that the saved arrays already reflect). Every other field, unless read below, must be
# unset (null, false, empty or "none").
_IGNORED = {
    "task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path",
    "revision", "inference_mode", "megatron_core", "qalora_group_size", "runtime_config",
    "loftq_config", "eva_config", "corda_config", "lora_ga_config", "ensure_weight_tying",
}
_READ = {"r", "lora_alpha", "lora_dropout", "use_rslora", "target_modules", "init_lora_weights"}
# What a refused field is, in words, when it is set.
_REFUSED = {
    "use_dora": "DoRA (weight-decomposed LoRA)",
    "bias": "bias training",
    "lora_bias": "a bias on lora_B",
    "modules_to_save": "modules_to_save (fully trained copies of modules)",
    "rank_pattern": "per-module ranks",
    "alpha_pattern": "per-module alphas",
    "layers_to_transform": "adapters on some blocks only",
    "layers_pattern": "adapters on some blocks only",
    "fan_in_fan_out": "fan_in_fan_out (GPT-2's Conv1D layout)",
    "exclude_modules": "exclude_modules",
    "trainable_token_indices": "trainable tokens",
}
# `init_lora_weights` values that change the base weights (the adapter is then not an
# update of the base checkpoint).
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq")


def _module_key(target: str, block: int, which: str) -> str:
    return f"{PREFIX}{TARGETS[target].module.format(i=block)}.lora_{which}.weight"


def _rope_order(target: str, config: DecoderConfig, rows: int) -> np.ndarray | None:
    return pairing_permutation(rows // config.head_dim, config.head_dim) if TARGETS[target].rope_rows else None


def to_peft(model: RotaryDecoder, path: str | os.PathLike, *, base_model_name_or_path: str | None = None) -> Path:
    """Write the adapters of `model` as a PEFT LoRA adapter directory.

    `path` receives `adapter_config.json` (`r`, `lora_alpha`, `target_modules`,
    `lora_dropout`, `use_rslora`, `bias="none"`, `task_type="CAUSAL_LM"`) and
    `adapter_model.safetensors` with PEFT's key names, atomically; other files are kept.
    `peft.PeftModel.from_pretrained(transformers_model, path)` then gives the adapted
    model's logits, the transformers model being the base (`eqrope.to_hf` of
    `eqrope.base_model(model)`). `base_model_name_or_path` is recorded for PEFT.

    **Returns:** the directory, as a `Path`.
    """
    settings = adapter_settings(model, "eqrope.to_peft")
    config, path = model.config, check_path(path, "eqrope.to_peft: path")
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"eqrope.to_peft: {path} is a file; pass a directory.")
    arrays = {n: np.asarray(a) for n, a in adapter_arrays(model).items()}
    tensors = {}
    for t in settings["targets"]:
        path_t = f"{TARGETS[t].weight.path}.{t}"
        a, b = arrays[path_t + ".a"], arrays[path_t + ".b"]
        for i in range(config.n_blocks):
            lora_b = b[i].T
            order = _rope_order(t, config, lora_b.shape[0])
            if order is not None:
                lora_b = lora_b[np.argsort(order)]
            tensors[_module_key(t, i, "A")] = np.ascontiguousarray(a[i].T)
            tensors[_module_key(t, i, "B")] = np.ascontiguousarray(lora_b)
    record = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": settings["rank"],
        "lora_alpha": settings["alpha"],
        "lora_dropout": settings["dropout"],
        "use_rslora": settings["rslora"],
        "target_modules": [TARGETS[t].peft for t in settings["targets"]],
        "bias": "none",
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }
    text = json.dumps(record, indent=2, allow_nan=False) + "\n"
    files = {ARRAYS_FILE: safetensors.numpy.save(tensors, metadata={"format": "pt"}), CONFIG_FILE: text.encode()}
    check_writable(path, "eqrope.to_peft", beside=True)
    _write_directory(path, files)
    return path


def from_peft(model: RotaryDecoder, path: str | os.PathLike) -> RotaryDecoder:
    """`model` with the PEFT LoRA adapter in the directory `path` (`adapter_config.json`
    and `adapter_model.safetensors`, as `PeftModel.save_pretrained` writes them).

    **Arguments:** `model`, the base the adapter was trained on (a
    [`eqrope.RotaryDecoder`][] without adapters, such as `eqrope.from_hf` of the base
    checkpoint; either layout, kept), and `path`.

    **Returns:** the adapted model, in `model`'s dtype; its logits are the PEFT model's.

    `target_modules` may be a list of module names (`"q_proj"`, or longer suffixes that
    name every block), a regular expression over the module names, or `"all-linear"`.
    Raises `ValueError` naming the field or tensor for what eqrope cannot express or
    what does not fit: DoRA (`use_dora`), bias training (`bias`, `lora_bias`),
    `modules_to_save`, a target module the model does not have, adapters on some
    blocks only, per-module ranks or alphas, any other field set away from its default,
    and a missing, unexpected or misshapen tensor.
    """
    check_base(model, "eqrope.from_peft")
    path = check_path(path, "eqrope.from_peft: path")
    config_file, arrays_file = path / CONFIG_FILE, path / ARRAYS_FILE
    if not config_file.is_file():
        raise FileNotFoundError(f"eqrope.from_peft: {config_file} is missing; pass a PEFT adapter directory.")
    if not arrays_file.is_file():
        bin_only = (path / "adapter_model.bin").is_file()
        raise FileNotFoundError(
            f"eqrope.from_peft: {arrays_file} is missing"
            + ("; only a pickled adapter_model.bin is there, which eqrope does not read: "
               "save it again with safe_serialization=True" if bin_only else "") + "."
        )
    record = read_json(config_file, "eqrope.from_peft")
    settings = _settings(record, model.config, f"eqrope.from_peft: {config_file}")
    try:
        with safetensors.safe_open(str(arrays_file), framework="numpy") as f:
            tensors = {n: f.get_tensor(n) for n in f.keys()}
    except Exception as e:  # safetensors' own errors for a damaged header
        raise ValueError(f"eqrope.from_peft: {arrays_file} is damaged ({type(e).__name__}: {e}).") from None
    expected = expected_arrays(model, settings)
    config, arrays, wanted = model.config, {}, {}
    for t in settings["targets"]:
        path_t = f"{TARGETS[t].weight.path}.{t}"
        a_shape, b_shape = expected[path_t + ".a"].shape[1:], expected[path_t + ".b"].shape[1:]
        for i in range(config.n_blocks):
            wanted[_module_key(t, i, "A")] = a_shape[::-1]
            wanted[_module_key(t, i, "B")] = b_shape[::-1]
    problems = [f"missing tensor {n!r}" for n in wanted if n not in tensors]
    problems += [f"unexpected tensor {n!r}" for n in tensors if n not in wanted]
    problems += [
        f"tensor {n!r} has shape {tuple(tensors[n].shape)}, the base model and r={settings['rank']} need {s}"
        for n, s in wanted.items() if n in tensors and tuple(tensors[n].shape) != tuple(s)
    ]  # fmt: skip
    if problems:
        raise ValueError(
            f"eqrope.from_peft: the tensors in {arrays_file} do not fit {config_file} and "
            "this base model:\n  " + "\n  ".join(problems)
            + "\nIs this adapter for this base model, saved whole?"
        )
    dtype = np.dtype(config.dtype)
    for t in settings["targets"]:
        path_t = f"{TARGETS[t].weight.path}.{t}"
        a_blocks, b_blocks = [], []
        for i in range(config.n_blocks):
            lora_b = tensors[_module_key(t, i, "B")]
            order = _rope_order(t, config, lora_b.shape[0])
            a_blocks.append(tensors[_module_key(t, i, "A")].T)
            b_blocks.append((lora_b if order is None else lora_b[order]).T)
        arrays[path_t + ".a"] = np.stack(a_blocks).astype(dtype)
        arrays[path_t + ".b"] = np.stack(b_blocks).astype(dtype)
    problems = compare_arrays(arrays, expected)
    if problems:  # a bug in this converter, not in the user's files
        raise AssertionError("from_peft built arrays that do not fit: " + "; ".join(problems))
    return with_adapter_arrays(model, settings, arrays)


def _settings(record: dict, config: DecoderConfig, where: str) -> dict:
    """The keywords of `eqrope.lora` a PEFT `adapter_config.json` describes, or a
    `ValueError` naming the field."""
    if record.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type is {record.get('peft_type')!r}; eqrope reads LoRA adapters ('LORA') only.")
    for field, value in record.items():
        if field in _IGNORED or field in _READ or _unset(field, value):
            continue
        what = _REFUSED.get(field, "a LoraConfig option")
        raise ValueError(
            f"{where} sets {field}={value!r}: {what}, which eqrope's adapters cannot "
            "express; eqrope reads plain LoRA (r, lora_alpha, lora_dropout, use_rslora, "
            "target_modules)."
        )
    init = record.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        raise ValueError(
            f"{where} sets init_lora_weights={init!r}, which changes the base weights too; "
            "convert the adapter to a plain LoRA of the original base first (PEFT's "
            "path_initial_model_for_weight_conversion)."
        )
    rank = checked(check_int, record.get("r", 8), "r", where, minimum=1)
    alpha = checked(check_float, record.get("lora_alpha", 8), "lora_alpha", where)
    if not alpha > 0:
        raise ValueError(f"{where}: lora_alpha must be > 0, got {alpha}.")
    dropout = checked(check_float, record.get("lora_dropout", 0.0), "lora_dropout", where)
    if not 0 <= dropout < 1:
        raise ValueError(f"{where}: lora_dropout must be in [0, 1), got {dropout}.")
    rslora = checked(check_bool, record.get("use_rslora", False), "use_rslora", where)
    targets = _targets(record.get("target_modules"), config, where)
    return dict(rank=rank, alpha=alpha, targets=targets, dropout=dropout, rslora=rslora)


def _unset(field: str, value) -> bool:
    return value in (None, False, {}, []) or (field == "bias" and value == "none")


def _targets(modules, config: DecoderConfig, where: str) -> tuple[str, ...]:
    """eqrope's targets from PEFT's `target_modules`, matched as PEFT matches them: a
    string is a regular expression over the full module names (or `"all-linear"`), a
    list entry names a module or a dotted suffix of its name."""
    available = [t for t in ALL_TARGETS if TARGETS[t].weight.exists(config)]
    names = {(t, i): TARGETS[t].module.format(i=i) for t in available for i in range(config.n_blocks)}
    if modules == "all-linear":
        return tuple(available)
    if isinstance(modules, str):
        try:
            pattern = re.compile(modules)
        except re.error as e:
            raise ValueError(f"{where}: target_modules {modules!r} is not a regular expression ({e}).") from None
        hits = {key for key, name in names.items() if pattern.fullmatch(name)}
        if not hits:
            raise ValueError(f"{where}: target_modules {modules!r} matches no module of the model (such as {names[available[0], 0]!r}).")
    elif isinstance(modules, list) and modules and all(isinstance(m, str) for m in modules):
        hits = set()
        for m in modules:
            found = {key for key, name in names.items() if name == m or name.endswith("." + m)}
            if not found:
                peft_names = ", ".join(TARGETS[t].peft for t in available)
                raise ValueError(
                    f"{where}: target_modules names {m!r}, a module this model does not "
                    f"have; its adaptable modules are {peft_names}."
                )
            hits |= found
    else:
        raise ValueError(f"{where}: target_modules must be a list of module names or a regular expression, got {modules!r}.")
    targets = tuple(t for t in available if any((t, i) in hits for i in range(config.n_blocks)))
    for t in targets:
        blocks = sorted(i for i in range(config.n_blocks) if (t, i) in hits)
        if len(blocks) != config.n_blocks:
            raise ValueError(
                f"{where}: target_modules adapts {TARGETS[t].peft} in blocks {blocks} only; "
                "eqrope's adapters cover every block."
            )
    return targets
