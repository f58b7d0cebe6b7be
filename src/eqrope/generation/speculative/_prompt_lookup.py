"""Draft-free speculation: draft the continuation of an earlier match of the text's end.

Prompt lookup decoding (Saxena 2023; transformers' `prompt_lookup_num_tokens`): the last
few tokens of the text are looked up earlier in the text (the prompt and what was
generated so far), and the tokens that followed that match are the draft. It costs no
model and drafts well wherever the output copies its input: extraction, editing, code,
quoting.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from ..._checks import check_int
from ..._custom_types import IntLike


@dataclasses.dataclass(frozen=True)
class PromptLookup:
    """`generate(..., draft=eqrope.PromptLookup(...))`: draft by n-gram lookup in the text.

    At each round, the longest suffix of the text, of at most `max_ngram` tokens and at
    least `min_ngram`, that also occurs earlier in the text is found (the most recent
    occurrence among the longest), and the `draft_len` tokens after that occurrence are
    the draft. A continuation that runs into the text's end goes on with the draft itself,
    so a repeating pattern drafts as far as asked. With no match, the draft repeats the
    last token. `draft="prompt_lookup"` is `PromptLookup()`.

    No suffix is longer than the call's cache, so a `max_ngram` past the cache length
    drafts as the cache length does, and the program's size does not grow with it.
    Refused: a `max_ngram` or `min_ngram` that is not an int (`TypeError`), below 1 or
    with `min_ngram > max_ngram` (`ValueError`).

    The draft is deterministic: under the residual rule a drafted token `x` is accepted
    with the target's probability of `x`.
    """

    max_ngram: IntLike = 4
    min_ngram: IntLike = 1

    def __post_init__(self):
        for name in ("max_ngram", "min_ngram"):
            object.__setattr__(self, name, check_int(getattr(self, name), name, minimum=1))
        if self.min_ngram > self.max_ngram:
            raise ValueError(
                f"PromptLookup(min_ngram={self.min_ngram}, max_ngram={self.max_ngram}): "
                "min_ngram must be at most max_ngram."
            )


# Up to this many suffix lengths the search is unrolled; past it, a while loop that stops
# with the longest run: the program's size does not grow with `max_ngram`.
UNROLL = 8


def lookup_draft(
    tokens: Int[Array, " max_len"], pos: Int[Array, ""], draft_len: int, lookup: PromptLookup
) -> Int[Array, " draft_len"]:
    """The draft for the tokens at `pos .. pos + draft_len - 1` of one row whose text is
    `tokens[:pos]` (`pos >= 1`).

    `match[j]` counts how many tokens before `j` equal the text's last ones (up to
    `max_ngram`): a match at `j` proposes `tokens[j], tokens[j + 1], ...`, and a
    continuation past the text repeats with period `pos - j`, the draft's own tokens.

    A suffix is at most `max_len - 1` tokens long (a match needs a token after it), so
    the search runs `min(max_ngram, max_len - 1)` lengths at most: unrolled up to
    `UNROLL` of them, else in a `jax.lax.while_loop` that also stops once no position
    still matches. Any `max_ngram` compiles a program of one size.
    """
    max_len = tokens.shape[0]
    j = jnp.arange(max_len, dtype=jnp.int32)
    longest = min(lookup.max_ngram, max_len - 1)

    def extend(back, run, match):
        """Runs of `back` tokens: the match at `j` grows where the one of `back - 1` did."""
        before = tokens[jnp.clip(j - back, 0, max_len - 1)]
        end = tokens[jnp.clip(pos - back, 0, max_len - 1)]
        run = run & (j - back >= 0) & (before == end)
        return run, match + run.astype(jnp.int32)

    # Only continuations inside the text, and not the text's end matching itself.
    run = j < pos
    match = jnp.zeros((max_len,), jnp.int32)
    if longest <= UNROLL:
        for back in range(1, longest + 1):
            run, match = extend(back, run, match)
    else:

        def going(carry):
            back, run, _ = carry
            return (back <= longest) & jnp.any(run)

        def grow(carry):
            back, run, match = carry
            return (back + 1, *extend(back, run, match))

        _, _, match = jax.lax.while_loop(going, grow, (jnp.ones((), jnp.int32), run, match))
    # The longest match, the most recent among equals: argmax finds the first maximum.
    score = match * max_len + j
    best = jnp.argmax(score).astype(jnp.int32)
    found = match[best] >= lookup.min_ngram
    start = jnp.where(found, best, pos - 1)
    period = jnp.maximum(pos - start, 1)
    offsets = jnp.arange(draft_len, dtype=jnp.int32) % period
    return tokens[jnp.clip(start + offsets, 0, max_len - 1)]


def lookup_drafts(
    tokens: Int[Array, "batch max_len"], pos: Int[Array, " batch"], draft_len: int, lookup: PromptLookup
) -> Int[Array, "batch draft_len"]:
    """`lookup_draft` for every row."""
    return jax.vmap(lookup_draft, in_axes=(0, 0, None, None))(tokens, pos, draft_len, lookup)
