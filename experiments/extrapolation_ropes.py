"""The ropes `extrapolation.py` compares: each method's `rope_base` and `rope_scaling`, a
trained rotary model's weights under another rope and `max_len`, and the methods as
command-line items.
"""

import dataclasses

import equinox as eqx
import jax

import eqrope


KINDS = ("linear", "ntk", "dynamic", "yarn", "llama3")


def rope_options(method: str, factor: float, *, base: float, head_dim: int,
                 original_max_len: int, max_len: int) -> dict:
    """The `rope_base` and `rope_scaling` of `DecoderConfig` for one method."""
    scaling = None
    if method == "ntk":
        base = base * factor ** (head_dim / (head_dim - 2))
    elif method == "linear":
        scaling = eqrope.RopeScaling("linear", factor)
    elif method == "dynamic":
        scaling = eqrope.RopeScaling(
            "dynamic", factor, original_max_len=original_max_len, max_len=max_len
        )
    elif method in ("yarn", "llama3"):
        scaling = eqrope.RopeScaling(method, factor, original_max_len=original_max_len)
    elif method != "none":
        raise ValueError(f"unknown method {method!r}; choose none or one of {KINDS}.")
    return {"rope_base": base, "rope_scaling": scaling}


def with_rope(model: eqrope.RotaryDecoder, method: str, factor: float, *, base: float,
              original_max_len: int, max_len: int) -> eqrope.RotaryDecoder:
    """The same weights under another rope and `max_len`.

    The rope lives in static fields (the model's `config` and each attention module's
    `rope_base` and `rope_scaling`), so the model is rebuilt from the changed config with
    `eqx.filter_eval_shape` (no compute) and refilled with the trained arrays. `base` is
    the base the model was trained with; the rates are always computed from it, so a
    fine-tuned model can be rescaled without compounding.
    """
    options = rope_options(method, factor, base=base, head_dim=model.config.head_dim,
                           original_max_len=original_max_len, max_len=max_len)
    config = dataclasses.replace(model.config, max_len=max_len, **options)
    shapes = eqx.filter_eval_shape(
        lambda: eqrope.RotaryDecoder.from_config(config, key=jax.random.PRNGKey(0)).with_layout(model.layout)
    )
    leaves = jax.tree.leaves(model)
    expected = [(a.shape, a.dtype) for a in jax.tree.leaves(shapes)]
    if [(a.shape, a.dtype) for a in leaves] != expected:
        raise ValueError(
            f"with_rope: max_len={max_len} changes the model's arrays (a learned position "
            "table); only rotary models can be rescaled."
        )
    return jax.tree.unflatten(jax.tree.structure(shapes), leaves)


def parse_methods(items: list[str]) -> list[tuple[str, float]]:
    """`["none", "linear:2", "yarn:1.5"]` -> `[("none", 1.0), ("linear", 2.0), ...]`."""
    out = []
    for item in items:
        method, _, factor = item.partition(":")
        if method not in ("none",) + KINDS:
            raise ValueError(f"unknown method {method!r} in {item!r}; choose none or one of {KINDS}.")
        out.append((method, 1.0 if method == "none" else float(factor or 2.0)))
    return out
