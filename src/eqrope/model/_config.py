"""The decoder's configuration: a small frozen record, validated once."""

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from ._attention_options import AttentionOptions
from .._checks import check_bool, check_float, check_int
from .._custom_types import IntLike, RealLike


_DTYPES = ("float32", "bfloat16", "float16", "float64")
# The positional arguments of `RotaryDecoder`, in the seed's order; every other field of
# `DecoderConfig` is a keyword option.
SIZES = ("vocab_size", "d_model", "n_heads", "n_blocks", "max_len")


# The fields each kind of `RopeScaling` reads; every other field must keep its default.
ROPE_KIND_FIELDS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_len"),
    "yarn": (
        "factor", "original_max_len", "beta_fast", "beta_slow", "attention_factor", "truncate"
    ),
    "dynamic": ("factor", "original_max_len", "max_len"),
}


@dataclasses.dataclass(frozen=True, repr=False)
class RopeScaling:
    """Rescaling of the rotary frequencies after training, as transformers computes it.

    - `kind="linear"`: every frequency is divided by `factor` (position interpolation).
    - `kind="llama3"`: the Llama 3.1 rule; long wavelengths are divided by `factor`, short
      ones kept, and a smooth ramp in between set by `low_freq_factor`, `high_freq_factor`
      and `original_max_len`.
    - `kind="yarn"`: YaRN (Peng et al. 2023, Eqs. 17-21): frequencies that turn fewer than
      `beta_slow` times over `original_max_len` positions are divided by `factor`, those
      that turn more than `beta_fast` times are kept, with a linear ramp between; cosines
      and sines are multiplied by `attention_factor` (`None`: `0.1 ln(factor) + 1`), so
      the scores `q . k` by its square. `truncate` rounds the ramp's ends to whole
      dimensions, as transformers does by default.
    - `kind="dynamic"`: NTK-aware scaling with the base enlarged once, to
      `base * (factor * max_len / original_max_len - (factor - 1)) ** (d / (d - 2))`:
      the rates transformers' dynamic scaling uses for a sequence of exactly `max_len`
      tokens. Set `max_len` to the model's `max_len` (or more); `max_len ==
      original_max_len` gives the unscaled rates. docs/weights.md says where this agrees with transformers.

    Each kind reads only its own fields (`ROPE_KIND_FIELDS`); another field set to a
    value other than its default raises, as does a non-finite or non-positive number.
    """

    kind: Literal["linear", "llama3", "yarn", "dynamic"]
    factor: RealLike
    low_freq_factor: RealLike = 1.0
    high_freq_factor: RealLike = 4.0
    original_max_len: IntLike = 8192
    beta_fast: RealLike = 32.0
    beta_slow: RealLike = 1.0
    attention_factor: RealLike | None = None
    truncate: bool = True
    max_len: IntLike | None = None

    def __post_init__(self):
        if self.kind not in ROPE_KIND_FIELDS:
            raise ValueError(
                f"RopeScaling.kind must be one of {tuple(ROPE_KIND_FIELDS)}, got {self.kind!r}."
            )
        object.__setattr__(self, "kind", str(self.kind))
        numbers = ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow")
        for name in numbers + ("attention_factor",):
            value = getattr(self, name)
            if value is None and name == "attention_factor":
                continue
            value = check_float(value, f"RopeScaling.{name}")
            if not value > 0:
                raise ValueError(f"RopeScaling.{name} must be > 0, got {value}.")
            object.__setattr__(self, name, value)
        for name in ("original_max_len", "max_len"):
            value = check_int(
                getattr(self, name), f"RopeScaling.{name}", minimum=1, none=name == "max_len"
            )
            object.__setattr__(self, name, value)
        object.__setattr__(self, "truncate", check_bool(self.truncate, "RopeScaling.truncate"))
        used = ROPE_KIND_FIELDS[self.kind]
        for f in dataclasses.fields(self):
            if f.name != "kind" and f.name not in used and getattr(self, f.name) != f.default:
                raise ValueError(
                    f"RopeScaling: kind={self.kind!r} does not use {f.name} (it reads "
                    f"{', '.join(used)}); leave {f.name} at its default {f.default!r}."
                )
        if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                "RopeScaling: llama3 needs high_freq_factor > low_freq_factor, got "
                f"{self.high_freq_factor} <= {self.low_freq_factor}."
            )
        if self.kind == "yarn" and not self.beta_fast > self.beta_slow:
            raise ValueError(
                "RopeScaling: yarn needs beta_fast > beta_slow, got "
                f"{self.beta_fast} <= {self.beta_slow}."
            )
        if self.kind == "dynamic" and (self.max_len or 0) < self.original_max_len:
            raise ValueError(
                "RopeScaling: dynamic needs max_len (the model's max_len) >= "
                f"original_max_len={self.original_max_len}, got {self.max_len}."
            )

    def __repr__(self) -> str:
        shown = ", ".join(f"{n}={getattr(self, n)!r}" for n in ROPE_KIND_FIELDS[self.kind])
        return f"RopeScaling(kind={self.kind!r}, {shown})"


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Everything that fixes a decoder's shapes and numerics.

    The defaults are the seed's rotary decoder: RMSNorm, SwiGLU, no biases except the
    head's, rotary positions with base 10000, float32.

    **Arguments:**

    - `vocab_size`, `d_model`, `n_heads`, `n_blocks`, `max_len`: the sizes.
    - `d_ff`: hidden width of the feed-forward layer; `None` means `4 * d_model`.
    - `n_kv_heads`: key/value heads (grouped-query attention); `None` means `n_heads`.
    - `attention`: the attention variants of the checkpoint families (head width, q/k/v
      biases, q/k norms, a sliding window), an [`eqrope.AttentionOptions`][]; `None`
      means the seed's attention.
    - `rope_base`, `rope_scaling`: the rotary frequencies (RoFormer Eq. 15).
    - `positions`: `"rope"` (rotary, the default) or `"learned"` (an absolute table of
      `max_len` rows added at the input, as in the textbook's chapter 1 model).
    - `norm`: `"rms"` (RMSNorm, weight only) or `"layer"` (LayerNorm, weight and bias).
    - `norm_eps`: the eps inside the root of either norm.
    - `mlp`: `"swiglu"` (Shazeer 2020 Eq. 6) or `"gelu"` (two layers with a GELU).
    - `bias`: biases on the attention and feed-forward projections.
    - `head_bias`: a bias on the output head.
    - `tie_embeddings`: the head reuses the token embedding (transposed).
    - `remat`: recompute each block in the backward pass (`eqx.filter_checkpoint`).
    - `dtype`: the dtype of weights and cache: a name or a dtype, `None` meaning float32
      (also under `jax_enable_x64`). It is stored by name. `float64` needs
      `jax.config.update("jax_enable_x64", True)` first.

    Every field is a plain JSON value after validation: NumPy scalars become `int`,
    `float` or `bool`; a value of the wrong type (`"false"` for a bool, `"32"` for a size,
    a NaN) raises `TypeError` or `ValueError` naming the field.
    """

    vocab_size: IntLike
    d_model: IntLike
    n_heads: IntLike
    n_blocks: IntLike
    max_len: IntLike
    d_ff: IntLike | None = None
    n_kv_heads: IntLike | None = None
    attention: AttentionOptions | None = None
    rope_base: RealLike = 10000.0
    rope_scaling: RopeScaling | None = None
    positions: Literal["rope", "learned"] = "rope"
    norm: Literal["rms", "layer"] = "rms"
    norm_eps: RealLike = 1e-5
    mlp: Literal["swiglu", "gelu"] = "swiglu"
    bias: bool = False
    head_bias: bool = True
    tie_embeddings: bool = False
    remat: bool = False
    dtype: DTypeLike | None = "float32"

    def __post_init__(self):
        for name in SIZES:
            object.__setattr__(self, name, check_int(getattr(self, name), name, minimum=1))
        if self.d_ff is None:
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        for name in ("d_ff", "n_kv_heads"):
            object.__setattr__(self, name, check_int(getattr(self, name), name, minimum=1))
        for name in ("rope_base", "norm_eps"):
            object.__setattr__(self, name, check_float(getattr(self, name), name))
        for name in ("bias", "head_bias", "tie_embeddings", "remat"):
            object.__setattr__(self, name, check_bool(getattr(self, name), name))
        if self.attention is None:
            object.__setattr__(self, "attention", AttentionOptions())
        if not isinstance(self.attention, AttentionOptions):
            raise TypeError(
                f"attention must be an eqrope.AttentionOptions or None, got {self.attention!r}."
            )
        # One spelling per model: the default head width and "every block" are None.
        a = self.attention
        if a.head_dim is not None and a.head_dim * self.n_heads == self.d_model:
            a = dataclasses.replace(a, head_dim=None)
        if a.window_blocks == tuple(range(self.n_blocks)):
            a = dataclasses.replace(a, window_blocks=None)
        object.__setattr__(self, "attention", a)
        if not isinstance(self.rope_scaling, (RopeScaling, type(None))):
            raise TypeError(
                f"rope_scaling must be an eqrope.RopeScaling or None, got {self.rope_scaling!r}."
            )
        object.__setattr__(self, "dtype", _dtype_name(self.dtype))
        if self.attention.head_dim is None and self.d_model % self.n_heads != 0:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                "choose n_heads that divides d_model, or set attention.head_dim."
            )
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"head_dim = {self.head_dim} is odd; rotary embeddings rotate pairs, so "
                "choose an even head width (d_model // n_heads, or attention.head_dim)."
            )
        blocks = self.attention.window_blocks or ()
        if blocks and blocks[-1] >= self.n_blocks:
            raise ValueError(
                f"attention.window_blocks names block {blocks[-1]}, but the model has "
                f"n_blocks={self.n_blocks} (indices 0..{self.n_blocks - 1})."
            )
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"n_heads={self.n_heads} is not divisible by n_kv_heads="
                f"{self.n_kv_heads}; each key/value head must serve a whole group."
            )
        if not self.rope_base > 1:
            raise ValueError(f"rope_base must be a finite number > 1, got {self.rope_base}.")
        if not self.norm_eps > 0:
            raise ValueError(f"norm_eps must be > 0, got {self.norm_eps}.")
        choices = {
            "positions": ("rope", "learned"),
            "norm": ("rms", "layer"),
            "mlp": ("swiglu", "gelu"),
            "dtype": _DTYPES,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"{name} must be one of {allowed}, got {getattr(self, name)!r}."
                )
            object.__setattr__(self, name, str(getattr(self, name)))
        if self.dtype == "float64" and jax.dtypes.canonicalize_dtype(jnp.float64) != np.float64:
            raise ValueError(
                "dtype='float64' needs jax_enable_x64, which is off: without it every array "
                "would silently be float32. Call jax.config.update('jax_enable_x64', True) "
                "before building or loading the model (or wrap the code in "
                "`with jax.enable_x64(True):`), or choose dtype='float32'."
            )
        if self.rope_scaling is not None and self.positions != "rope":
            raise ValueError("rope_scaling is set but positions is not 'rope'.")
        scaling = self.rope_scaling
        if scaling is not None and scaling.kind == "dynamic" and scaling.max_len < self.max_len:
            raise ValueError(
                f"rope_scaling is dynamic with max_len={scaling.max_len}, but the model's "
                f"max_len is {self.max_len}; the rates are fixed for a sequence of "
                "rope_scaling.max_len tokens, which must cover the model's, so pass the "
                "model's max_len (or more) to both."
            )

    @property
    def head_dim(self) -> int:
        """The width of each head: `attention.head_dim`, else `d_model // n_heads`."""
        return self.attention.head_dim or self.d_model // self.n_heads

    @property
    def has_qkv_bias(self) -> bool:
        """Whether the query, key and value projections have biases."""
        return self.bias or self.attention.qkv_bias

    @property
    def has_out_bias(self) -> bool:
        """Whether the attention's output projection has a bias."""
        return self.bias or self.attention.out_bias

    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)

    def options(self) -> dict:
        """Every field but the five sizes: the keyword options of
        `RotaryDecoder(vocab_size, d_model, n_heads, n_blocks, max_len, **options, key=key)`."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in SIZES}

    def to_dict(self) -> dict:
        """A JSON-ready dict; `DecoderConfig.from_dict` inverts it."""
        out = dataclasses.asdict(self)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "DecoderConfig":
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - fields
        if unknown:
            raise ValueError(f"Unknown DecoderConfig fields: {sorted(unknown)}.")
        data = dict(data)
        for name, record in (("attention", AttentionOptions), ("rope_scaling", RopeScaling)):
            data[name] = _record(data.get(name), name, record)
        return cls(**data)


def _record(value, name: str, record: type):
    """The `record` (a frozen dataclass) a JSON object describes; `None` stays `None`."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise TypeError(
            f"{name} must be a JSON object (the fields of {record.__name__}) or null, "
            f"got {value!r}."
        )
    unknown = set(value) - {f.name for f in dataclasses.fields(record)}
    if unknown:
        raise ValueError(f"Unknown {record.__name__} fields: {sorted(unknown)}.")
    return record(**value)


def _dtype_name(dtype) -> str:
    if dtype is None:
        return "float32"
    try:
        name = jnp.dtype(dtype).name
    except TypeError:
        raise ValueError(f"dtype must be one of {_DTYPES} or None, got {dtype!r}.") from None
    return name
