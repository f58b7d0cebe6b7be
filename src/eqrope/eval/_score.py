"""`eqrope.score`: the log-probability of every token of a ragged batch under the model.

Three ways to run a row, one compiled program each:

- plain: each row, padded on the right to a power-of-two bucket, in one pass of
  `jax.vmap(model)`; the program compiles once per (rows, bucket), so a new length within a
  bucket does not recompile;
- shared prefix: a prefix is prefilled once into a cache, and every continuation runs
  against that cache, as the choices of a multiple-choice question need;
- rolling windows: a row longer than one pass is cut into windows of `window + 1` tokens
  whose ends advance by `stride`, each token scored once, with at least `window - stride +
  1` tokens of context (lm-eval's `loglikelihood_rolling` is `stride = window`).

Each is planned on the host (which tokens a pass reads, which it scores), run in passes
of a fixed number of rows, and gathered back into `(batch, seq)` arrays. The plain pass is
in `_plain.py`, rolling windows in `_windows.py`, a shared prefix in `_prefix.py`, the
shapes of a pass in `_buckets.py`, and the checks of the arguments in `_arguments.py`.
"""

import equinox as eqx
import numpy as np
from jaxtyping import Bool, Float

from .._custom_types import IntLike
from ..sharding._rules import ShardingRules
from ._arguments import check_arguments, row_multiple
from ._prefix import Continuation, Group, run_groups
from ._windows import adapted_rows, rolling_windows, run_pieces


class Scores(eqx.Module):
    """What [`eqrope.score`][] returns, as NumPy arrays on the host.

    - `logprobs`: at each scored position `p` of a row, `log p(tokens[p] | tokens[:p])`
      (after the `prefix`, if any) in float32; 0 at positions not scored.
    - `greedy`: at each scored position, whether the token is the model's argmax there
      (the first of tied maxima, as `argmax` picks); `False` at positions not scored.
    - `total`: each row's sum of `logprobs`, the log-likelihood of its scored tokens.
    - `all_greedy`: whether every scored token of the row is greedy (lm-eval's
      `is_greedy`).

    A 1-D `tokens` gives `(seq,)` arrays and 0-d `total` and `all_greedy`.
    """

    logprobs: Float[np.ndarray, "*batch seq"]
    greedy: Bool[np.ndarray, "*batch seq"]
    total: Float[np.ndarray, "*batch"]
    all_greedy: Bool[np.ndarray, "*batch"]


def score(
    model,
    tokens,
    prompt_lengths=None,
    lengths=None,
    *,
    prefix=None,
    window: IntLike | None = None,
    stride: IntLike | None = None,
    batch_size: IntLike | None = None,
    mesh=None,
    rules: ShardingRules | None = None,
) -> Scores:
    """Each token's log-probability under `model`, and whether it was the argmax.

    **Arguments:**

    - `model`: a causal model `ids (seq,) -> logits (seq, vocab)` with integer `max_len`
      and `vocab_size` attributes, such as [`eqrope.RotaryDecoder`][] or a wrapper around
      one; a `prefix` needs the cache protocol (`init_cache`, `prefill`). With adapters
      chosen per row ([`eqrope.select_adapters`][]), row `i` scores with adapter `ids[i]`
      (the passes reorder the adapters with the rows), and `tokens` has one row per id.
    - `tokens`: `(batch, seq)` token ids, each row padded on the right, or `(seq,)` for
      one row.
    - `prompt_lengths`: for each row, how many of its first tokens are context only: the
      tokens at positions `prompt_lengths[i] .. lengths[i] - 1` are scored. Default 1
      (every token but the first, which has nothing before it), or 0 with a `prefix`. An
      int applies to every row.
    - `lengths`: each row's real length (default: every row is full). An int applies to
      every row.
    - `prefix`: `(p,)` token ids that come before every row. They are prefilled once into a
      cache and every row runs against it, so `p` tokens are computed once instead of once
      per row (the choices of a multiple-choice question). Row `i` then scores as
      `score(model, prefix + row_i, prompt_lengths=p + prompt_lengths[i])` does, up to
      float rounding. (With adapters chosen per row, each row's adapter changes the
      prefix's keys: each row then runs that way, with the prefix written in.)
    - `window`: the most tokens one pass reads (default `model.max_len`). A row scores
      in one pass when `lengths[i] <= window + 1` (its last token is only predicted, never
      read); longer rows need `stride`.
    - `stride`: score rows longer than one pass in rolling windows: windows of
      `window + 1` tokens whose ends advance by `stride`; each token is scored once, in
      the first window that holds it, so it sees at least `window - stride + 1` tokens
      of context. `stride=window` is lm-eval's `loglikelihood_rolling` (`context_len=1`).
    - `batch_size`: the most rows (or windows) per pass; default every row in one pass,
      and as many windows per pass as `tokens` has rows.
    - `mesh`, `rules`: run a model placed with `eqrope.shard(model, mesh, rules)`: the rows
      of each pass go on the `batch` rule's mesh axis (padded to a multiple of its size),
      and the results are replicated.

    **Returns:** a [`eqrope.Scores`][] with `logprobs` and `greedy` of `tokens`' shape, and
    each row's `total` and `all_greedy`.

    Each pass is one compiled program whose shapes are the rows per pass and a
    power-of-two bucket (at least 16, at most `window`) of the longest row it reads, so
    new lengths within a bucket do not recompile; with a `prefix`, the buckets of the
    prefix and of the rows. Log-probabilities are `logits - logsumexp(logits)` in float32
    whatever the model's dtype.

    Raises `ValueError`, naming the argument, for an empty continuation
    (`prompt_lengths[i] >= lengths[i]`), a token id outside the vocabulary, rows that
    do not fit one pass without `stride`, lengths outside int32, a ragged list of rows,
    and rows that do not match a model's adapters chosen per row.
    """
    checked = check_arguments(
        model, tokens, prompt_lengths, lengths, prefix, window, stride, batch_size
    )
    ids, lengths, firsts, prefix, window, stride, batch_size = checked
    multiple = row_multiple(mesh, rules)
    lead = 0
    if prefix is not None and adapted_rows(model) is not None:
        # Each row's adapter changes the prefix's keys too, so no prefill is shared: each
        # row reads the prefix written in (`_arguments` checked that it fits one pass).
        lead = prefix.shape[0]
        ids = np.concatenate([np.broadcast_to(prefix, (ids.shape[0], lead)), ids], axis=1)
        lengths, firsts, prefix = lengths + lead, firsts + lead, None
    batch, seq = ids.shape
    logprobs = np.zeros((batch, seq), np.float32)
    greedy = np.zeros((batch, seq), bool)
    if prefix is None:
        pieces = [
            piece
            for row in range(batch)
            for piece in rolling_windows(row, int(lengths[row]), int(firsts[row]), window, stride)
        ]
        for piece, lp, gr in run_pieces(
            model,
            ids,
            pieces,
            rows=batch_size or batch,
            window=window,
            multiple=multiple,
            mesh=mesh,
            rules=rules,
        ):
            scored = slice(piece.first, piece.last + 1)
            logprobs[piece.row, scored], greedy[piece.row, scored] = lp, gr
    else:
        rows = [Continuation(ids[i, : lengths[i]], int(firsts[i])) for i in range(batch)]
        group = Group(prefix, rows)
        for (_, index), lp, gr in run_groups(
            model, [group], rows=batch_size or batch, multiple=multiple, mesh=mesh, rules=rules
        ):
            logprobs[index, : lengths[index]], greedy[index, : lengths[index]] = lp, gr
    if lead:
        logprobs, greedy = logprobs[:, lead:], greedy[:, lead:]
        lengths, firsts, seq = lengths - lead, firsts - lead, seq - lead
    total = logprobs.sum(axis=-1, dtype=np.float32)
    scored = np.arange(seq)[None, :] >= firsts[:, None]
    scored &= np.arange(seq)[None, :] < lengths[:, None]
    all_greedy = np.where(scored, greedy, True).all(axis=-1)
    if np.ndim(tokens) == 1:
        return Scores(logprobs[0], greedy[0], total[:1].reshape(()), all_greedy[:1].reshape(()))
    return Scores(logprobs, greedy, total, all_greedy)
