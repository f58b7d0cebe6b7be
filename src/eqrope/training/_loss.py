"""The next-token loss: mean cross-entropy over kept positions, in float32."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from .._checks import as_int_array, check_int, check_vocab
from .._custom_types import IntLike


def cross_entropy(
    model,
    ids: Int[Array, "batch seq"],
    targets: Int[Array, "batch seq"],
    mask: Bool[Array, "batch seq"] | None = None,
    *,
    ignore_id: IntLike | None = -100,
) -> Float[Array, ""]:
    """Mean next-token cross-entropy of `model` over the kept positions.

    **Arguments:**

    - `model`: called as `jax.vmap(model)(ids)`, giving logits `(batch, seq, vocab)`.
    - `ids`: the input token ids.
    - `targets`: `targets[b, t]` is the token that should follow `ids[b, :t+1]`.
    - `mask`: `False` (or 0) leaves a position out; `None` keeps every position.
    - `ignore_id`: a target equal to it leaves its position out, as `mask=False` does
      (`-100`, the convention of transformers and PyTorch, by default; `None`: none).

    **Returns:** the mean over the positions kept by both `mask` and `ignore_id`; 0 if
    none is kept. The log-softmax runs in float32.

    Any other target outside `[0, vocab)` raises, also under `jit` (`eqx.error_if`):
    JAX's gather would otherwise return NaN, or the loss of another token.
    """
    ignore_id = check_int(ignore_id, "ignore_id", none=True)
    for name, x in (("ids", ids), ("targets", targets)):
        if getattr(x, "ndim", None) == 1:
            raise ValueError(
                f"{name} must have rank 2, (batch, seq), got one sequence of shape "
                f"{x.shape}: the loss takes a batch of rows. For one sequence pass "
                "ids[None], targets[None] (and mask[None]); for several, stack them into "
                "(batch, seq) arrays."
            )
    targets = as_int_array(targets, "targets", ndim=2)
    logits = jax.vmap(model)(ids).astype(jnp.float32)
    if targets.shape != logits.shape[:2]:
        raise ValueError(
            f"targets must have the shape of ids {logits.shape[:2]}, got {targets.shape}."
        )
    ignored = jnp.zeros(targets.shape, bool) if ignore_id is None else targets == ignore_id
    try:
        targets = check_vocab(jnp.where(ignored, 0, targets), logits.shape[-1], "targets")
    except ValueError as e:
        raise ValueError(
            f"{e} Leave positions out with mask=False or a target of ignore_id "
            f"(now {ignore_id})."
        ) from None
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    weights = (~ignored).astype(jnp.float32)
    if mask is not None:
        weights = weights * mask.astype(jnp.float32)
    total = jnp.sum(jnp.where(weights != 0, nll * weights, 0.0))
    return total / jnp.maximum(jnp.sum(weights), 1.0)
