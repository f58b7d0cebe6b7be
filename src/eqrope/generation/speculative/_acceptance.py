"""Speculative sampling's accept/reject rules: keep a drafted token, or replace it.

At each drafted position the target's distribution `p` (its logits after every processor
of `generate`: penalties, masks, temperature, top-k, top-p, min-p) judges the draft's
token `x`, drawn from the draft's distribution `q` (the draft model's logits after the same
processors, or a point mass for prompt lookup). Two rules, both exact: the tokens they
keep are distributed as the target's own samples.

- `"residual"` (Leviathan et al. 2023; Chen et al. 2023): keep `x` with probability
  `min(1, p(x) / q(x))`; otherwise draw the token from the residual `max(p - q, 0)`,
  normalised. The most drafts a rule can keep: the chance to keep is `sum(min(p, q))`.
- `"coupled"`: keep `x` when it equals the target's own draw at that position, the token
  plain `generate` samples there with the same key; otherwise that draw is the token. So
  the text equals plain `generate`'s for the same key. The draft draws with the same key
  (the same Gumbel noise), which makes the two draws agree often when `p` is close to
  `q`, though less often than the residual rule keeps.

Greedy decoding (`temperature=0`) has one rule: keep `x` when it is the target's
argmax. Keys, for the row key `k` and a position `t`, with `kt = fold_in(k, t)`: the
target's own draw and the draft's draw use `kt`, as plain `generate` does; the residual
rule's uniform uses `fold_in(kt, 1)` and its residual draw `fold_in(kt, 2)`.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, Key

from .._sampling import Sampling, draw


RULES = ("residual", "coupled")


def judge(
    processed: Float[Array, " vocab"],
    key: Key[Array, ""],
    position: Int[Array, ""],
    drafted: Int[Array, ""],
    draft_logq: Float[Array, " vocab"] | None,
    is_draft: Bool[Array, ""],
    sampling: Sampling,
    rule: str,
) -> tuple[Int[Array, ""], Float[Array, ""], Bool[Array, ""]]:
    """The token at `position` of one row, given the target's processed float32 logits
    there.

    `drafted` is the draft's token and `draft_logq` the log-probabilities it was drawn
    from (`None`: a point mass, prompt lookup). Where `is_draft` is false (the position
    after the last drafted one), the token is the target's own draw.

    **Returns:** `(token, logprob, kept)`: the token, its log-probability under the
    target's distribution as `draw` gives it (what plain `generate` reports), and whether
    it is the drafted token, kept.
    """
    temperature = jnp.asarray(sampling.temperature)
    own, logp = draw(processed, key, position, sampling)

    def matched(_):
        kept = is_draft & (drafted == own)
        return jnp.where(kept, drafted, own), kept

    def residual(_):
        kt = jax.random.fold_in(key, position)
        p = jnp.exp(logp)
        if draft_logq is None:
            logq_x = jnp.zeros((), jnp.float32)
            q = jax.nn.one_hot(drafted, p.shape[0], dtype=p.dtype)
        else:
            logq_x, q = draft_logq[drafted], jnp.exp(draft_logq)
        u = jax.random.uniform(jax.random.fold_in(kt, 1), dtype=jnp.float32)
        kept = is_draft & (jnp.log(u) < logp[drafted] - logq_x)
        rest = jnp.maximum(p - q, 0.0)
        fixed = jax.random.categorical(jax.random.fold_in(kt, 2), jnp.log(rest)).astype(jnp.int32)
        # `rest` is all zeros only when p equals q to rounding: then p is the residual.
        fixed = jnp.where(is_draft & (jnp.sum(rest) > 0), fixed, own)
        return jnp.where(kept, drafted, fixed), kept

    if rule == "coupled":
        token, kept = matched(None)
    else:
        token, kept = jax.lax.cond(temperature > 0, residual, matched, None)
    return token, logp[token], kept
