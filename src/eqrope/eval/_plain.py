"""One compiled plain pass: every row, padded on the right, through `jax.vmap(model)`, and
the scores of the tokens a pass reads (`token_scores`, which the shared-prefix pass uses too).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from .._log import compiling
from ..generation._arrays import rebuild, split_model
from ..model import RotaryDecoder
from ..sharding._rules import constrain, shard_batch


def plain_pass(model, inputs, targets, lo, hi, *, mesh=None, rules=None):
    """One compiled plain pass: `(logprobs, greedy)` of `targets` `(rows, width)` after
    `inputs`, at positions `lo .. hi - 1` of each row (0 and `False` elsewhere)."""
    if mesh is not None:
        inputs, targets, lo, hi = shard_batch((inputs, targets, lo, hi), mesh, rules)
    arrays, structure = split_model(model)
    out = plain_program(
        arrays, inputs, targets, lo, hi, structure=structure, mesh=mesh, rules=rules
    )
    return tuple(np.asarray(x) for x in out)


@functools.partial(jax.jit, static_argnames=("structure", "mesh", "rules"))
def plain_program(arrays, inputs, targets, lo, hi, *, structure, mesh, rules):
    rows, width = inputs.shape
    compiling("eval", "score", f"{rows} rows x {width} tokens", "rows or length bucket")
    model = rebuild(arrays, structure)
    logits = jax.vmap(functools.partial(_logits, model))(inputs)
    return constrain(token_scores(logits, targets, lo, hi), mesh, rules)


def _logits(model, ids: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
    """The model's logits; a decoder's unchecked core (the ids are checked on the host)."""
    if isinstance(model, RotaryDecoder):
        return model.forward(ids, jnp.arange(ids.shape[0], dtype=jnp.int32))[0]
    return model(ids)


def token_scores(
    logits: Float[Array, "*rows seq vocab"],
    targets: Int[Array, "*rows seq"],
    lo: Int[Array, "*rows"],
    hi: Int[Array, "*rows"],
) -> tuple[Float[Array, "*rows seq"], Bool[Array, "*rows seq"]]:
    """`log_softmax(logits)[target]` in float32 and `argmax(logits) == target`, at the
    positions `lo .. hi - 1` of each row; 0 and `False` elsewhere."""
    logits = logits.astype(jnp.float32)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    logprobs = picked - jax.nn.logsumexp(logits, axis=-1)
    greedy = jnp.argmax(logits, axis=-1).astype(targets.dtype) == targets
    index = jnp.arange(targets.shape[-1], dtype=lo.dtype)
    scored = (index >= lo[..., None]) & (index < hi[..., None])
    return jnp.where(scored, logprobs, 0.0), greedy & scored
