"""The projections an adapter can target, read from the weight table.

The targets are named after PEFT's `target_modules` without `_proj` (`q`, `k`, `v`, `o`,
`gate`, `up`, `down`): one row per Hugging Face projection of `eqrope.weights._table`.
"""

import dataclasses
import functools
from collections.abc import Callable

from ..model._config import DecoderConfig
from ..weights._table import WEIGHTS, Weight, _sizes



@dataclasses.dataclass(frozen=True)
class Target:
    """One projection an adapter can target.

    - `name`: eqrope's name (`"q"`), PEFT's `target_modules` entry without `_proj`.
    - `weight`: the table row of the array that holds it (`blocks.attn.wqkv`).
    - `part`: its index among that array's fused parts (q, k, v are 0, 1, 2).
    - `module`: the Hugging Face module, `{i}` for the block (`model.layers.{i}.self_attn.q_proj`).
    """

    name: str
    weight: Weight
    part: int
    module: str

    @property
    def peft(self) -> str:
        """PEFT's `target_modules` name: `"q_proj"`."""
        return self.module.rsplit(".", 1)[1]

    @property
    def rope_rows(self) -> bool:
        """Whether its output columns carry the rotary pairing permutation (q and k)."""
        return self.weight.rope_rows[self.part]


def _targets() -> dict[str, Target]:
    found = {}
    for w in WEIGHTS:
        if not (w.stacked and w.transpose and w.hf):
            continue
        for part, hf in enumerate(w.hf):
            module = hf.removesuffix(".weight")
            name = module.rsplit(".", 1)[1].removesuffix("_proj")
            found[name] = Target(name, w, part, module)
    return found


TARGETS = _targets()
ALL_TARGETS = tuple(TARGETS)  # ("q", "k", "v", "o", "gate", "up", "down")


def check_targets(targets, config: DecoderConfig, name: str = "targets") -> tuple[str, ...]:
    """`targets` as a tuple of eqrope target names in the table's order, or a `TypeError`
    / `ValueError` naming `name` and the fix."""
    if isinstance(targets, str) or not isinstance(targets, (tuple, list)):
        raise TypeError(
            f"{name} must be a tuple of target names such as ('q', 'v'), got {targets!r}; "
            f"the targets are {', '.join(ALL_TARGETS)}."
        )
    if not targets:
        raise ValueError(f"{name} is empty; name at least one of {', '.join(ALL_TARGETS)}.")
    for t in targets:
        if not isinstance(t, str) or t not in TARGETS:
            peft = {tg.peft: tg.name for tg in TARGETS.values()}
            hint = f" ({t!r} is PEFT's name; eqrope's is {peft[t]!r})" if t in peft else ""
            raise ValueError(
                f"{name}: unknown target {t!r}{hint}; eqrope's targets are "
                f"{', '.join(ALL_TARGETS)} (PEFT's {', '.join(tg.peft for tg in TARGETS.values())})."
            )
        if not TARGETS[t].weight.exists(config):
            raise ValueError(
                f"{name}: the model has no {t!r} projection (its mlp is {config.mlp!r}; "
                f"only 'swiglu' has gate, up and down); choose among "
                f"{', '.join(n for n, tg in TARGETS.items() if tg.weight.exists(config))}."
            )
    if len(set(targets)) != len(targets):
        raise ValueError(f"{name} names a target twice: {tuple(targets)}.")
    return tuple(n for n in ALL_TARGETS if n in targets)


def part_widths(weight: Weight, config: DecoderConfig) -> tuple[int, ...]:
    """The output columns of each fused part of `weight` (one entry if not fused): an
    adapted weight's fused dimension, if any, is its last (`wqkv`, `w_gate_up`)."""
    sizes, last = _sizes(config), weight.block_axes[-1]
    return tuple(sizes[p] for p in (last if isinstance(last, tuple) else (last,)))


def get_path(model, path: str):
    """The field at a dotted table path (`"blocks.attn.wqkv"`) of a stacked model."""
    return functools.reduce(getattr, path.split("."), model)


def places(model, path: str) -> list[tuple[Callable, int | None]]:
    """Where the arrays of the table path `path` lie in `model`, as `(where, block)`
    pairs for `eqx.tree_at`: one for a stacked model (`block` None: every block's, on a
    leading axis), one per block for an unstacked one (each block's own array)."""
    if model.layout == "stacked" or not path.startswith("blocks."):
        return [(lambda m: get_path(m, path), None)]
    rest = path.removeprefix("blocks.")
    return [(lambda m, i=i: get_path(m.blocks[i], rest), i) for i in range(len(model.blocks))]


# -- the modules ----------------------------------------------------------------------------
