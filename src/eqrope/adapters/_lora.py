"""Adapting a model (`eqrope.lora`), merging adapters into its weights and back, and the
split between the trainable factors and the frozen rest.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import PRNGKeyArray

from .._checks import check_bool, check_float, check_int, check_key
from .._custom_types import IntLike, RealLike
from ..model._decoder import RotaryDecoder
from ..model._init import uniform_weight
from ..weights._table import BY_PATH
from ._targets import TARGETS, check_targets, part_widths, places
from ._weight import LoraWeight, LowRank, is_lora, lora_weights


def check_base(model, who: str) -> RotaryDecoder:
    """`model` if it is a `RotaryDecoder` without adapters; else a `TypeError`."""
    if not isinstance(model, RotaryDecoder):
        raise TypeError(f"{who} takes an eqrope.RotaryDecoder, got {type(model).__name__}.")
    if lora_weights(model):
        raise TypeError(
            f"{who}: the model already has adapters; pass eqrope.merge(model) to build on "
            "the merged weights, or eqrope.base_model(model) for the base without them."
        )
    return model


def check_adapted(model, who: str) -> RotaryDecoder:
    """`model` if it is a `RotaryDecoder` with adapters; else a `TypeError`."""
    if not isinstance(model, RotaryDecoder):
        raise TypeError(
            f"{who} takes a RotaryDecoder with adapters (from eqrope.lora), got "
            f"{type(model).__name__}."
        )
    if not lora_weights(model):
        raise TypeError(
            f"{who}: the model has no adapters; add them with eqrope.lora(model, ...)."
        )
    return model


def lora(
    model: RotaryDecoder,
    *,
    rank: IntLike = 8,
    alpha: RealLike = 8.0,
    targets=("q", "v"),
    dropout: RealLike = 0.0,
    rslora: bool = False,
    key: PRNGKeyArray,
) -> RotaryDecoder:
    """The model with a new low-rank adapter on each of `targets`, in every block.

    **Arguments:**

    - `model`: an [`eqrope.RotaryDecoder`][] without adapters, either layout (kept).
    - `rank`: the rank `r` of every update (PEFT's `r`).
    - `alpha`: the update's scale is `alpha / rank` (PEFT's `lora_alpha`), or
      `alpha / sqrt(rank)` with `rslora=True` (PEFT's `use_rslora`).
    - `targets`: a tuple of `"q"`, `"k"`, `"v"`, `"o"`, `"gate"`, `"up"`, `"down"`,
      PEFT's `q_proj`, ..., `down_proj`. The defaults of `rank`, `alpha` and `targets`
      are PEFT's for Llama.
    - `dropout`: dropout on each update's input while training (PEFT's `lora_dropout`);
      [`eqrope.make_adapter_train_step`][] draws it from its `key`.
    - `key`: draws `A` as PEFT does (`U(-1/sqrt(d_in), 1/sqrt(d_in))`); `B` is zero.

    **Returns:** a `RotaryDecoder` whose targeted weight arrays are
    [`eqrope.LoraWeight`][]s; its logits are bitwise those of `model` until `B` changes.
    The base arrays are `model`'s own (not copied), in either layout: an unstacked
    model (as `from_hf` and `load` return it) gets one adapter per block, sliced from
    the same draws as a stacked model's.

    Raises `TypeError` / `ValueError` naming the argument: an unknown or missing target,
    `rank < 1`, `alpha <= 0`, `dropout` outside `[0, 1)`, a bool or a string where a
    number goes (and a number for `rslora`), a `key` that is not a PRNG key, a model that
    already has adapters.
    """
    check_base(model, "eqrope.lora")
    rank = check_int(rank, "rank", minimum=1)
    alpha = check_float(alpha, "alpha")
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0 (the update's scale is alpha / rank), got {alpha}.")
    dropout = check_float(dropout, "dropout")
    if not 0 <= dropout < 1:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}.")
    rslora = check_bool(rslora, "rslora")
    key = check_key(key)
    config = model.config
    targets = check_targets(targets, config)
    keys = dict(zip(targets, jax.random.split(key, len(targets))))
    dtype, n_blocks = config.jnp_dtype, config.n_blocks
    for path in dict.fromkeys(TARGETS[t].weight.path for t in targets):
        weight = BY_PATH[path]
        spots = places(model, path)  # the whole stack, or each block's own array
        d_in, widths = spots[0][0](model).shape[-2], part_widths(weight, config)
        names = tuple(t.name for t in TARGETS.values() if t.weight.path == path)
        drawn = tuple(
            LowRank(
                uniform_weight(keys[n], d_in, (n_blocks, d_in, rank), dtype),
                jnp.zeros((n_blocks, rank, w), dtype),
                alpha=alpha, rslora=rslora, dropout=dropout,
            ) if n in targets else None
            for n, w in zip(names, widths)
        )  # fmt: skip
        for where, block in spots:  # the same draws in either layout; the base is not copied
            parts = drawn if block is None else tuple(None if p is None else jax.tree.map(lambda x: x[block], p) for p in drawn)
            adapted = LoraWeight(where(model), parts, None, None, widths=widths, names=names, path=path)
            model = eqx.tree_at(where, model, adapted)
    return model


def _replace_lora(model, fn):
    return jax.tree.map(lambda x: fn(x) if is_lora(x) else x, model, is_leaf=is_lora)


def merge(model: RotaryDecoder) -> RotaryDecoder:
    """A plain [`eqrope.RotaryDecoder`][] with each adapter added into its weight
    (`W + scale * A @ B`, summed in float32, or in float64 for a float64 model): the
    adapted model's logits within the rounding of the model's dtype, at the base model's
    cost. `eqrope.to_hf` and `eqrope.save` take it."""
    check_adapted(model, "eqrope.merge")
    return _replace_lora(model, LoraWeight.merged)


def base_model(model: RotaryDecoder) -> RotaryDecoder:
    """The base model of an adapted one: each [`eqrope.LoraWeight`][] replaced by its
    frozen weight (bitwise the model `eqrope.lora` was given)."""
    check_adapted(model, "eqrope.base_model")
    return _replace_lora(model, lambda w: w.weight)


def unmerge(merged: RotaryDecoder, adapted: RotaryDecoder) -> RotaryDecoder:
    """The inverse of [`eqrope.merge`][]: `adapted`'s adapters over the base weights
    `merged - scale * A @ B` (summed as `merge` sums: within the rounding of float32,
    or of float64 for a float64 model, of the base `adapted` had).

    `merged` is a plain `RotaryDecoder` of `adapted`'s config and layout, such as
    `eqrope.merge(adapted)` or that model after more full fine-tuning.
    """
    check_adapted(adapted, "eqrope.unmerge")
    check_base(merged, "eqrope.unmerge")
    if merged.config != adapted.config or merged.layout != adapted.layout:
        raise ValueError(
            "eqrope.unmerge: merged and adapted must have one config and one layout; "
            f"got layouts {merged.layout!r} and {adapted.layout!r}"
            + ("" if merged.config == adapted.config else " and different configs") + "."
        )
    # `adapted`'s structure with each LoraWeight as a leaf is a prefix of `merged`'s.
    return jax.tree.map(lambda w, m: w.unmerged(m) if is_lora(w) else m, adapted, merged, is_leaf=is_lora)


# -- the trainable arrays -------------------------------------------------------------------


def adapter_spec(model) -> object:
    """A filter spec for `eqx.partition`: `True` on the `A` and `B` arrays of every
    adapter, `False` everywhere else (the base, the row ids, the dropout keys)."""
    is_part = lambda x: isinstance(x, LowRank)  # noqa: E731
    mark = lambda x: jax.tree.map(eqx.is_inexact_array, x) if is_part(x) else False  # noqa: E731
    return jax.tree.map(mark, model, is_leaf=is_part)


def split_adapters(model) -> tuple[object, object]:
    """`(adapters, rest)`: `eqx.partition` by `adapter_spec`; `eqx.combine` joins them."""
    return eqx.partition(model, adapter_spec(model))
