"""Rotary settings between a Hugging Face config and `eqrope.RopeScaling`, both ways.

One table (`_HF_NAMES` over `ROPE_KIND_FIELDS`) says which key of a `rope_parameters` /
`rope_scaling` dict is which `RopeScaling` field; `read_rope` (for `from_hf`) and
`write_rope` (for `to_hf`) both read it, so the round trip is exact.
"""

import dataclasses

from .._checks import check_bool, check_float, check_int
from .._json import checked
from ..model._config import ROPE_KIND_FIELDS, DecoderConfig, RopeScaling
from ..model._rope import yarn_mscale


# RopeScaling field -> Hugging Face key, where the names differ.
_HF_NAMES = {"original_max_len": "original_max_position_embeddings"}
# Fields that transformers takes from `max_position_embeddings`, not from the dict.
_FROM_MAX_POSITIONS = {"dynamic": ("original_max_len", "max_len")}
# Fields a Hugging Face dict must name, and those where null means transformers' default
# (`beta_fast or 32`, ...); the others must hold a value of their type if present.
_REQUIRED = ("factor", "low_freq_factor", "high_freq_factor")
_NULL_IS_DEFAULT = ("beta_fast", "beta_slow", "attention_factor")
# How each field is checked; the rest are finite numbers.
_CHECKS = {"original_max_len": (check_int, {"minimum": 1}), "truncate": (check_bool, {})}
# Keys allowed with every type; transformers ignores `original_max_position_embeddings`
# where the type has no use for it (`linear`, `dynamic`), and so does eqrope.
_COMMON_KEYS = {
    "rope_type",
    "type",
    "rope_theta",
    "partial_rotary_factor",
    "attention_factor",
    "original_max_position_embeddings",
}
# yarn's two keys transformers folds into the attention factor (DeepSeek's configs).
_MSCALE_KEYS = ("mscale", "mscale_all_dim")


def _hf_fields(kind: str) -> dict[str, str]:
    """Hugging Face key -> `RopeScaling` field, for the fields of `kind` the dict holds."""
    skip = _FROM_MAX_POSITIONS.get(kind, ())
    return {_HF_NAMES.get(f, f): f for f in ROPE_KIND_FIELDS[kind] if f not in skip}


def valid(check, value, name: str, source: str, **kwargs):
    """`check(value, name, **kwargs)`, its error raised as a `ValueError` naming `source`."""
    return checked(check, value, name, f"from_hf: {source}", **kwargs)


def check_above(value, name: str, bound: float = 0.0) -> float:
    """A finite number greater than `bound`, as `float` (`check_float` with a range)."""
    value = check_float(value, name)
    if not value > bound:
        raise ValueError(f"{name} must be > {bound:g}, got {value!r}.")
    return value


def read_rope(hf: dict, source: str, max_len: int) -> dict:
    """`rope_base` and `rope_scaling` for `DecoderConfig`, from a Hugging Face `config.json`
    dict whose `max_position_embeddings` is `max_len`."""
    # transformers >= 5 writes `rope_parameters`; older versions `rope_theta` + `rope_scaling`.
    # As in transformers, a non-empty `rope_scaling` wins.
    field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    params = hf.get(field)
    params = {} if params is None else params
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        raise ValueError(
            f"from_hf: {source} has {field}={params!r}; eqrope supports one flat dict "
            "(per-layer rotary parameters are not supported)."
        )
    kind = params.get("rope_type", params.get("type", "default"))
    if not isinstance(kind, str) or (kind != "default" and kind not in ROPE_KIND_FIELDS):
        raise ValueError(
            f"from_hf: {source} has {field} type {kind!r}; eqrope supports 'default', "
            f"{', '.join(repr(k) for k in ROPE_KIND_FIELDS)} rotary scaling."
        )
    fields = {} if kind == "default" else _hf_fields(kind)
    known = _COMMON_KEYS | set(fields) | (set(_MSCALE_KEYS) if kind == "yarn" else set())
    unknown = sorted(set(params) - known)
    if unknown:
        raise ValueError(
            f"from_hf: {source} has {field} keys {unknown} that eqrope does not know "
            f"for type {kind!r}; refusing to ignore them."
        )

    def number(name, value):
        return valid(check_float, value, name, source)

    # eqrope's rotary frequencies need a base above 1 (rope_base); 10000 is every family's default.
    if "rope_theta" in params:
        theta, theta_key = params["rope_theta"], f"{field}.rope_theta"
    else:
        theta, theta_key = hf.get("rope_theta", 10000.0), "rope_theta"
    base = valid(check_above, theta, theta_key, source, bound=1.0)
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial is not None and number("partial_rotary_factor", partial) != 1.0:
        raise ValueError(
            f"from_hf: {source} sets partial_rotary_factor; eqrope rotates the whole head."
        )
    attention = params.get("attention_factor")
    if kind != "yarn" and attention is not None and number("attention_factor", attention) != 1:
        raise ValueError(
            f"from_hf: {source} sets {field}.attention_factor; eqrope (as transformers) "
            f"rescales attention only for yarn, not for type {kind!r}."
        )
    if kind == "default":
        return dict(rope_base=base, rope_scaling=None)
    scaling = dict(kind=kind)
    for key, name in fields.items():
        value, where = params.get(key), f"{field}.{key}"
        if key == "original_max_position_embeddings":
            # As transformers: a top-level original_max_position_embeddings wins, else the
            # dict's, else max_position_embeddings.
            if hf.get(key) is not None:
                value, where = hf[key], key
            elif key not in params:
                value, where = max_len, "max_position_embeddings"
        if value is None and name in _REQUIRED:
            raise ValueError(
                f"from_hf: {source} has {field} type {kind!r} without a {key!r}."
            )
        if value is None and (name in _NULL_IS_DEFAULT or key not in params):
            continue
        check, kwargs = _CHECKS.get(name, (check_above, {}))
        scaling[name] = valid(check, value, where, source, **kwargs)
    for name in _FROM_MAX_POSITIONS.get(kind, ()):
        scaling[name] = max_len
    _check_order(scaling, field, source)
    if kind == "yarn" and scaling.get("attention_factor") is None:
        scaling.update(_mscale_attention(params, scaling["factor"], number))
    try:
        return dict(rope_base=base, rope_scaling=RopeScaling(**scaling))
    except ValueError as e:
        raise ValueError(f"from_hf: {source} has an invalid {field}: {e}") from None


# The pairs of fields each kind needs in order (low, high), with RopeScaling's defaults.
_ORDERED = {"llama3": ("low_freq_factor", "high_freq_factor"), "yarn": ("beta_slow", "beta_fast")}


def _check_order(scaling: dict, field: str, source: str) -> None:
    """Refuse, by their keys in the file, a llama3 `high_freq_factor <= low_freq_factor`
    or a yarn `beta_fast <= beta_slow` (the ramp between them would be empty or reversed)."""
    pair = _ORDERED.get(scaling["kind"])
    if pair is None:
        return
    defaults = {f.name: f.default for f in dataclasses.fields(RopeScaling)}
    low, high = (scaling.get(n, defaults[n]) for n in pair)
    if not high > low:
        raise ValueError(
            f"from_hf: {source} has {field}.{pair[1]}={high} <= {field}.{pair[0]}={low}; "
            f"{scaling['kind']} needs {pair[1]} > {pair[0]}."
        )


def _mscale_attention(params: dict, factor: float, number) -> dict:
    """transformers' yarn attention factor from `mscale` and `mscale_all_dim`, when both
    are set and non-zero; otherwise nothing (the default `0.1 ln(factor) + 1`)."""
    mscale, all_dim = (params.get(k) for k in _MSCALE_KEYS)
    mscale = None if mscale is None else number("mscale", mscale)
    all_dim = None if all_dim is None else number("mscale_all_dim", all_dim)
    if not (mscale and all_dim):
        return {}
    return dict(attention_factor=yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim))


def write_rope(c: DecoderConfig) -> dict:
    """The Hugging Face `rope_parameters` dict of `c`; `read_rope` gives `c`'s back."""
    rope = {"rope_type": "default", "rope_theta": c.rope_base}
    s = c.rope_scaling
    if s is None:
        return rope
    if s.kind == "dynamic" and not s.original_max_len == s.max_len == c.max_len:
        raise ValueError(
            "to_hf: the model's dynamic rope scaling has original_max_len="
            f"{s.original_max_len}, max_len={s.max_len} and the model max_len={c.max_len}; "
            "transformers' dynamic scaling takes max_position_embeddings as the original "
            "length and recomputes the rates as a sequence grows, so it would not give this "
            "model's logits. Only dynamic scalings with all three equal (as from_hf "
            "reads them) can be written."
        )
    rope["rope_type"] = s.kind
    for key, name in _hf_fields(s.kind).items():
        if getattr(s, name) is not None:
            rope[key] = getattr(s, name)
    return rope
