"""The decoder's configuration: a small frozen record, validated once."""

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from ._checks import check_bool, check_float, check_int


_DTYPES = ("float32", "bfloat16", "float16", "float64")
# The positional arguments of `RotaryDecoder`, in the seed's order; every other field of
# `DecoderConfig` is a keyword option.
SIZES = ("vocab_size", "d_model", "n_heads", "n_blocks", "max_len")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Rescaling of the rotary frequencies after training.

    - `kind="linear"`: every frequency is divided by `factor` (position interpolation).
    - `kind="llama3"`: the Llama 3.1 rule; long wavelengths are divided by `factor`, short
      ones kept, and a smooth ramp in between set by `low_freq_factor`, `high_freq_factor`
      and `original_max_len`.
    """

    kind: Literal["linear", "llama3"]
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_len: int = 8192

    def __post_init__(self):
        if self.kind not in ("linear", "llama3"):
            raise ValueError(
                f"RopeScaling.kind must be 'linear' or 'llama3', got {self.kind!r}."
            )
        object.__setattr__(self, "kind", str(self.kind))
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            object.__setattr__(self, name, check_float(getattr(self, name), f"RopeScaling.{name}"))
        value = check_int(self.original_max_len, "RopeScaling.original_max_len", minimum=1)
        object.__setattr__(self, "original_max_len", value)
        if not self.factor > 0:
            raise ValueError(f"RopeScaling.factor must be > 0, got {self.factor}.")
        if self.kind == "llama3" and not self.low_freq_factor > 0:
            raise ValueError(
                f"RopeScaling: llama3 needs low_freq_factor > 0, got {self.low_freq_factor}."
            )
        if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                "RopeScaling: llama3 needs high_freq_factor > low_freq_factor, got "
                f"{self.high_freq_factor} <= {self.low_freq_factor}."
            )


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Everything that fixes a decoder's shapes and numerics.

    The defaults are the seed's rotary decoder: RMSNorm, SwiGLU, no biases except the
    head's, rotary positions with base 10000, float32.

    **Arguments:**

    - `vocab_size`, `d_model`, `n_heads`, `n_blocks`, `max_len`: the sizes.
    - `d_ff`: hidden width of the feed-forward layer; `None` means `4 * d_model`.
    - `n_kv_heads`: key/value heads (grouped-query attention); `None` means `n_heads`.
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

    vocab_size: int
    d_model: int
    n_heads: int
    n_blocks: int
    max_len: int
    d_ff: int | None = None
    n_kv_heads: int | None = None
    rope_base: float = 10000.0
    rope_scaling: RopeScaling | None = None
    positions: Literal["rope", "learned"] = "rope"
    norm: Literal["rms", "layer"] = "rms"
    norm_eps: float = 1e-5
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
        if not isinstance(self.rope_scaling, (RopeScaling, type(None))):
            raise TypeError(
                f"rope_scaling must be an eqrope.RopeScaling or None, got {self.rope_scaling!r}."
            )
        object.__setattr__(self, "dtype", _dtype_name(self.dtype))
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                "choose n_heads that divides d_model."
            )
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"head_dim = d_model // n_heads = {self.head_dim} is odd; rotary "
                "embeddings rotate pairs, so choose d_model and n_heads with an even ratio."
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

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

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
        scaling = data.get("rope_scaling")
        if scaling is not None:
            if not isinstance(scaling, dict):
                raise TypeError(
                    f"rope_scaling must be a JSON object (the fields of RopeScaling) or null, "
                    f"got {scaling!r}."
                )
            unknown = set(scaling) - {f.name for f in dataclasses.fields(RopeScaling)}
            if unknown:
                raise ValueError(f"Unknown RopeScaling fields: {sorted(unknown)}.")
            data["rope_scaling"] = RopeScaling(**scaling)
        return cls(**data)


def _dtype_name(dtype) -> str:
    if dtype is None:
        return "float32"
    try:
        name = jnp.dtype(dtype).name
    except TypeError:
        raise ValueError(f"dtype must be one of {_DTYPES} or None, got {dtype!r}.") from None
    return name
