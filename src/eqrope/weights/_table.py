"""The decoder's arrays, one row each: path, logical axes, Hugging Face names.

Every array of a [`eqrope.RotaryDecoder`][] has one `Weight` row in `WEIGHTS`, and
everything that knows arrays by name reads it: the sharding rules (`_sharding`, from
`axes`) and the Hugging Face import and export (`_hf_import`, `_hf_export`, through
`hf_shapes`, `from_hf` and `to_hf`). Adding a weight is adding a row.

**Axes.** One logical axis per dimension, from the glossary (`blocks`, `vocab`, `d_model`,
`heads`, `kv_heads`, `head_dim`, `d_ff`, `max_len`). The arrays of the stacked blocks
start with `blocks`. `heads` on a flattened `heads * head_dim` dimension counts heads, so a
shard always holds whole heads. A tuple is a *fused* dimension, the concatenation of its
parts in order: `wqkv`'s columns are `[q heads | k heads | v heads]`.

**Hugging Face layout.** Each part of a fused dimension is its own tensor, named in `hf`
(`{i}` is the block index). `nn.Linear` stores `(out, in)` where eqrope's `x @ W` stores
`(in, out)` (`transpose`). The rows of the query and key parts are permuted from
rotate-half to interleaved pairing (`rope_rows`, `_hf.pairing_permutation`).
"""

import dataclasses
from collections.abc import Callable, Iterator, Mapping

import numpy as np

from ..model._config import DecoderConfig
from ._hf import pairing_permutation
from ._stream import empty


Axes = tuple[str | tuple[str, ...], ...]


@dataclasses.dataclass(frozen=True)
class Weight:
    """One array of the decoder.

    - `path`: its pytree path in a `RotaryDecoder`, e.g. `"blocks.attn.wqkv"`.
    - `axes`: the logical axis of each dimension; a tuple entry is a fused dimension.
    - `when`: the config fields (and values) under which the array exists; `{}`: always.
      A field of `config.attention` is named without the prefix (`qk_norm`).
    - `hf`: the Hugging Face tensor of each part, or `()` when there is none.
    - `transpose`: the Hugging Face tensors are stored transposed (`nn.Linear`).
    - `rope_rows`: per part, whether its rows get the rotary pairing permutation.
    """

    path: str
    axes: Axes
    when: Mapping[str, object] = dataclasses.field(default_factory=dict)
    hf: tuple[str, ...] = ()
    transpose: bool = False
    rope_rows: tuple[bool, ...] = ()

    def __post_init__(self):
        fused = [a for a in self.axes if isinstance(a, tuple)]
        if len(fused) > 1:
            raise ValueError(f"Weight {self.path}: at most one fused dimension, got {fused}.")
        if self.hf and len(self.hf) != len(self.parts):
            raise ValueError(f"Weight {self.path}: one Hugging Face name per part {self.parts}.")
        if not self.rope_rows:
            object.__setattr__(self, "rope_rows", (False,) * len(self.parts))
        if len(self.rope_rows) != len(self.parts):
            raise ValueError(f"Weight {self.path}: one rope_rows flag per part {self.parts}.")

    @property
    def stacked(self) -> bool:
        """Whether the array is one of the stacked blocks' (a leading `blocks` axis)."""
        return self.axes[0] == "blocks"

    @property
    def block_axes(self) -> Axes:
        """The axes of one block's slice (of the array itself, if not stacked)."""
        return self.axes[1:] if self.stacked else self.axes

    @property
    def part_dim(self) -> int:
        """The dimension of `block_axes` that is split into parts: the fused one, else 0."""
        return next((d for d, a in enumerate(self.block_axes) if isinstance(a, tuple)), 0)

    @property
    def parts(self) -> tuple[str, ...]:
        """The logical axis of each part along `part_dim` (one part if nothing is fused)."""
        axis = self.block_axes[self.part_dim]
        return axis if isinstance(axis, tuple) else (axis,)

    def exists(self, config: DecoderConfig) -> bool:
        """Whether a model with `config` has this array. `when` names fields (or
        properties) of the config, or of its `attention` options."""
        def get(field):
            owner = config.attention if hasattr(config.attention, field) else config
            return getattr(owner, field)

        return all(get(field) == value for field, value in self.when.items())


_LAYER = "model.layers.{i}."
_QKV = ("heads", "kv_heads", "kv_heads")
_GATE_UP = ("d_ff", "d_ff")
_BIAS = {"bias": True}
_QK_NORM = {"qk_norm": True}
_SWIGLU, _GELU = {"mlp": "swiglu"}, {"mlp": "gelu"}
_LAYER_NORM = {"norm": "layer"}

WEIGHTS = (
    Weight("embed", ("vocab", "d_model"), hf=("model.embed_tokens.weight",)),
    Weight("pos_embed", ("max_len", "d_model"), when={"positions": "learned"}),
    Weight("blocks.attn_norm.weight", ("blocks", "d_model"), hf=(_LAYER + "input_layernorm.weight",)),
    Weight("blocks.attn_norm.bias", ("blocks", "d_model"), when=_LAYER_NORM),
    Weight(
        "blocks.attn.wqkv",
        ("blocks", "d_model", _QKV),
        hf=tuple(_LAYER + f"self_attn.{p}_proj.weight" for p in "qkv"),
        transpose=True,
        rope_rows=(True, True, False),
    ),
    Weight(
        "blocks.attn.bqkv",
        ("blocks", _QKV),
        when={"has_qkv_bias": True},
        hf=tuple(_LAYER + f"self_attn.{p}_proj.bias" for p in "qkv"),
        rope_rows=(True, True, False),
    ),
    Weight(
        "blocks.attn.wo",
        ("blocks", "heads", "d_model"),
        hf=(_LAYER + "self_attn.o_proj.weight",),
        transpose=True,
    ),
    Weight(
        "blocks.attn.bo",
        ("blocks", "d_model"),
        when={"has_out_bias": True},
        hf=(_LAYER + "self_attn.o_proj.bias",),
    ),
    Weight(
        "blocks.attn.q_norm.weight",
        ("blocks", "head_dim"),
        when=_QK_NORM,
        hf=(_LAYER + "self_attn.q_norm.weight",),
        rope_rows=(True,),
    ),
    Weight(
        "blocks.attn.k_norm.weight",
        ("blocks", "head_dim"),
        when=_QK_NORM,
        hf=(_LAYER + "self_attn.k_norm.weight",),
        rope_rows=(True,),
    ),
    Weight(
        "blocks.mlp_norm.weight",
        ("blocks", "d_model"),
        hf=(_LAYER + "post_attention_layernorm.weight",),
    ),
    Weight("blocks.mlp_norm.bias", ("blocks", "d_model"), when=_LAYER_NORM),
    Weight(
        "blocks.mlp.w_gate_up",
        ("blocks", "d_model", _GATE_UP),
        when=_SWIGLU,
        hf=(_LAYER + "mlp.gate_proj.weight", _LAYER + "mlp.up_proj.weight"),
        transpose=True,
    ),
    Weight(
        "blocks.mlp.b_gate_up",
        ("blocks", _GATE_UP),
        when=_SWIGLU | _BIAS,
        hf=(_LAYER + "mlp.gate_proj.bias", _LAYER + "mlp.up_proj.bias"),
    ),
    Weight(
        "blocks.mlp.w_down",
        ("blocks", "d_ff", "d_model"),
        when=_SWIGLU,
        hf=(_LAYER + "mlp.down_proj.weight",),
        transpose=True,
    ),
    Weight(
        "blocks.mlp.b_down",
        ("blocks", "d_model"),
        when=_SWIGLU | _BIAS,
        hf=(_LAYER + "mlp.down_proj.bias",),
    ),
    Weight("blocks.mlp.w_in", ("blocks", "d_model", "d_ff"), when=_GELU),
    Weight("blocks.mlp.b_in", ("blocks", "d_ff"), when=_GELU | _BIAS),
    Weight("blocks.mlp.w_out", ("blocks", "d_ff", "d_model"), when=_GELU),
    Weight("blocks.mlp.b_out", ("blocks", "d_model"), when=_GELU | _BIAS),
    Weight("final_norm.weight", ("d_model",), hf=("model.norm.weight",)),
    Weight("final_norm.bias", ("d_model",), when=_LAYER_NORM),
    Weight(
        "head",
        ("d_model", "vocab"),
        when={"tie_embeddings": False},
        hf=("lm_head.weight",),
        transpose=True,
    ),
    Weight("head_bias", ("vocab",), when={"head_bias": True}),
)
BY_PATH = {w.path: w for w in WEIGHTS}


def axis_counts(config: DecoderConfig) -> dict[str, int]:
    """The length of each logical axis; `heads` and `kv_heads` count heads."""
    return {
        "blocks": config.n_blocks,
        "vocab": config.vocab_size,
        "d_model": config.d_model,
        "heads": config.n_heads,
        "kv_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "d_ff": config.d_ff,
        "max_len": config.max_len,
    }


def hf_shapes(config: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every Hugging Face tensor of a model with `config`, by name."""
    sizes = _sizes(config)
    shapes = {}
    for w, i in _hf_slots(config):
        for name, part in zip(w.hf, w.parts):
            axes = [part if d == w.part_dim else a for d, a in enumerate(w.block_axes)]
            shape = tuple(sizes[a] for a in axes)
            shapes[name.format(i=i)] = shape[::-1] if w.transpose else shape
    return shapes


def from_hf(
    copy: Callable[..., None], config: DecoderConfig, layout: str
) -> Iterator[tuple[str, np.ndarray]]:
    """eqrope's arrays, one at a time, filled from Hugging Face tensors checked by `hf_shapes`.

    `copy(name, out, transpose=..., row_order=...)` writes the tensor `name` into `out`,
    a view of the array, transposed and its rows reordered as asked (`_stream.Reader.copy`).
    Yields `(name, array)` in `config.dtype`: with `layout="stacked"` the stacked blocks'
    arrays whole (`"blocks.attn.wqkv"`), with `"unstacked"` one per block, named as the
    unstacked decoder's leaves (`"blocks.3.attn.wqkv"`). Each array is allocated once
    (`_stream.empty`) and filled part by part, block by block; none is kept once yielded.
    """
    dt, sizes = np.dtype(config.dtype), _sizes(config)
    for w in _hf_rows(config):
        shape = tuple(
            sum(sizes[p] for p in a) if isinstance(a, tuple) else sizes[a] for a in w.block_axes
        )
        if not w.stacked:
            out = empty(shape, dt)
            _fill_block(out, w, 0, copy, config, sizes)
            yield w.path, out
        elif layout == "stacked":
            out = empty((config.n_blocks, *shape), dt)
            for i in range(config.n_blocks):
                _fill_block(out[i], w, i, copy, config, sizes)
            yield w.path, out
        else:
            for i in range(config.n_blocks):
                out = empty(shape, dt)
                _fill_block(out, w, i, copy, config, sizes)
                yield unstacked_name(w.path, i), out


def unstacked_name(path: str, i: int) -> str:
    """The name of block `i`'s array of the stacked `path` in an unstacked decoder:
    `"blocks.attn.wqkv"` -> `"blocks.3.attn.wqkv"`."""
    return f"blocks.{i}.{path.removeprefix('blocks.')}"


def _fill_block(out: np.ndarray, w: Weight, i: int, copy, config: DecoderConfig, sizes) -> None:
    """Block `i`'s slice `out` of the array `w`, part by part along `part_dim`."""
    for name, part, rope in _parts(out, w, sizes):
        rows = part.shape[-1] if w.transpose else part.shape[0]
        order = _row_order(rows, config) if rope else None
        copy(name.format(i=i), part, transpose=w.transpose, row_order=order)


def to_hf(arrays: Mapping[str, np.ndarray], config: DecoderConfig) -> dict[str, np.ndarray]:
    """Hugging Face tensors by name, from eqrope's arrays by path (the inverse of `from_hf`)."""
    sizes = _sizes(config)
    out = {}
    for w, i in _hf_slots(config):
        a = np.asarray(arrays[w.path])
        a = a[i] if w.stacked else a
        for name, part, rope in _parts(a, w, sizes):
            t = part.T if w.transpose else part
            t = t[np.argsort(_row_order(t.shape[0], config))] if rope else t
            out[name.format(i=i)] = np.ascontiguousarray(t)
    return out


def _parts(a: np.ndarray, w: Weight, sizes: dict[str, int]):
    """`(Hugging Face name, view of a, rope_rows flag)` for each part of one block's `a`."""
    ends = np.cumsum([sizes[p] for p in w.parts])[:-1]
    return zip(w.hf, np.split(a, ends, axis=w.part_dim), w.rope_rows)


def _hf_rows(config: DecoderConfig) -> list[Weight]:
    """The rows of the arrays of `config`, each of which has Hugging Face tensors."""
    rows = [w for w in WEIGHTS if w.exists(config)]
    missing = [w.path for w in rows if not w.hf]
    if missing:  # the callers refuse such configs first, saying why
        raise ValueError(f"the arrays {missing} have no Hugging Face counterpart.")
    return rows


def _hf_slots(config: DecoderConfig) -> Iterator[tuple[Weight, int]]:
    """`(weight, block)` for each array (block) of `config`: the unstacked, then block by block."""
    rows = _hf_rows(config)
    yield from ((w, 0) for w in rows if not w.stacked)
    for i in range(config.n_blocks):
        yield from ((w, i) for w in rows if w.stacked)


def _sizes(config: DecoderConfig) -> dict[str, int]:
    """The length of each logical axis in array elements (heads times `head_dim`)."""
    counts = axis_counts(config)
    widths = {"heads": config.head_dim, "kv_heads": config.head_dim}
    return {a: n * widths.get(a, 1) for a, n in counts.items()}


def _row_order(rows: int, config: DecoderConfig) -> np.ndarray:
    """Interleaved from rotate-half pairing over `rows` rows, whole heads of `head_dim`."""
    return pairing_permutation(rows // config.head_dim, config.head_dim)
