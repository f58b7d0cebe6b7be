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
of a fixed number of rows, and gathered back into `(batch, seq)` arrays.
"""

import dataclasses
import functools
from collections.abc import Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from .._checks import as_int_array, check_int, check_vocab, is_concrete
from ..generation._arrays import rebuild, split_model
from ..generation._request import has_cache_protocol
from ..model import RotaryDecoder
from ..sharding._mesh import mesh_size
from ..sharding._rules import ShardingRules, constrain, shard_batch


# The shortest bucket of a pass's inputs, and of a continuation under a shared prefix.
MIN_BUCKET = 16
MIN_CONTINUATION_BUCKET = 8


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
    window: int | None = None,
    stride: int | None = None,
    batch_size: int | None = None,
    mesh=None,
    rules: ShardingRules | None = None,
) -> Scores:
    """Each token's log-probability under `model`, and whether it was the argmax.

    **Arguments:**

    - `model`: a causal model `ids (seq,) -> logits (seq, vocab)` with integer `max_len`
      and `vocab_size` attributes, such as [`eqrope.RotaryDecoder`][] or a wrapper around
      one; a `prefix` needs the cache protocol (`init_cache`, `prefill`).
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
      float rounding.
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
    (`prompt_lengths[i] >= lengths[i]`), a token id outside the vocabulary, and rows that
    do not fit one pass without `stride`.
    """
    checked = _check(model, tokens, prompt_lengths, lengths, prefix, window, stride, batch_size)
    ids, lengths, firsts, prefix, window, stride, batch_size = checked
    multiple = _row_multiple(mesh, rules)
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
    total = logprobs.sum(axis=-1, dtype=np.float32)
    scored = np.arange(seq)[None, :] >= firsts[:, None]
    scored &= np.arange(seq)[None, :] < lengths[:, None]
    all_greedy = np.where(scored, greedy, True).all(axis=-1)
    if np.ndim(tokens) == 1:
        return Scores(logprobs[0], greedy[0], total[:1].reshape(()), all_greedy[:1].reshape(()))
    return Scores(logprobs, greedy, total, all_greedy)


# -- plain passes and rolling windows -------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Piece:
    """What one row of a plain pass reads and scores: the row's tokens `start .. last - 1`
    are read, and positions `first .. last` (inclusive) are scored, each from the
    logits of the position before it."""

    row: int
    start: int
    first: int
    last: int


def rolling_windows(
    row: int, length: int, first: int, window: int, stride: int | None
) -> list[Piece]:
    """The pieces that score positions `first .. length - 1` of a row of `length` tokens.

    One piece when `length <= window + 1`. Otherwise (with `stride`) window `k` ends at
    position `e_k = min(length - 1, window + k * stride)`, reads the `window` tokens
    before it and scores positions `e_{k-1} + 1 .. e_k` (from `first` on); this is
    `lm_eval.utils.get_rolling_token_windows` with `context_len = window - stride + 1`,
    passed through `make_disjoint_window`.
    """
    last = length - 1
    if last <= window:
        return [Piece(row, 0, first, last)]
    pieces, done, k = [], first - 1, 0
    while done < last:
        end = min(last, window + k * stride)
        if end > done:
            pieces.append(Piece(row, max(0, end - window), done + 1, end))
            done = end
        k += 1
    return pieces


def run_pieces(
    model,
    ids: np.ndarray | Sequence[np.ndarray],
    pieces: Sequence[Piece],
    *,
    rows: int,
    window: int,
    multiple: int = 1,
    mesh=None,
    rules=None,
    on_pass: Callable[[int], object] | None = None,
):
    """Run `pieces` of the rows of `ids` (a 2-D array, or a list of 1-D rows) in plain
    passes of `rows` rows (the last padded), the longest first; yield `(piece, logprobs,
    greedy)` for each, over its scored positions only. `on_pass(n)` is called after each
    pass with the number of pieces it held."""
    order = sorted(range(len(pieces)), key=lambda i: pieces[i].start - pieces[i].last)
    rows = _round_up(rows, multiple)
    for begin in range(0, len(order), rows):
        chunk = [pieces[i] for i in order[begin : begin + rows]]
        width = bucket(max(p.last - p.start for p in chunk), window)
        inputs = np.zeros((rows, width), np.int32)
        targets = np.zeros((rows, width), np.int32)
        lo = np.zeros((rows,), np.int32)
        hi = np.zeros((rows,), np.int32)
        for j, p in enumerate(chunk):
            n = p.last - p.start
            inputs[j, :n] = ids[p.row][p.start : p.last]
            targets[j, :n] = ids[p.row][p.start + 1 : p.last + 1]
            lo[j], hi[j] = p.first - p.start - 1, n
        logprobs, greedy = plain_pass(model, inputs, targets, lo, hi, mesh=mesh, rules=rules)
        for j, p in enumerate(chunk):
            yield p, logprobs[j, lo[j] : hi[j]], greedy[j, lo[j] : hi[j]]
        if on_pass is not None:
            on_pass(len(chunk))


def plain_pass(model, inputs, targets, lo, hi, *, mesh=None, rules=None):
    """One compiled plain pass: `(logprobs, greedy)` of `targets` `(rows, width)` after
    `inputs`, at positions `lo .. hi - 1` of each row (0 and `False` elsewhere)."""
    if mesh is not None:
        inputs, targets, lo, hi = shard_batch((inputs, targets, lo, hi), mesh, rules)
    arrays, structure = split_model(model)
    out = _plain_program(
        arrays, inputs, targets, lo, hi, structure=structure, mesh=mesh, rules=rules
    )
    return tuple(np.asarray(x) for x in out)


@functools.partial(jax.jit, static_argnames=("structure", "mesh", "rules"))
def _plain_program(arrays, inputs, targets, lo, hi, *, structure, mesh, rules):
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


# -- a shared prefix --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Continuation:
    """A row after a shared prefix: its tokens, and the first of them to score."""

    ids: np.ndarray
    first: int = 0


@dataclasses.dataclass(frozen=True)
class Group:
    """Rows that share a prefix (at least one token)."""

    prefix: np.ndarray
    rows: Sequence[Continuation]


def run_groups(
    model,
    groups: Sequence[Group],
    *,
    rows: int,
    multiple: int = 1,
    mesh=None,
    rules=None,
    on_pass: Callable[[int], object] | None = None,
):
    """Score every row of `groups` against its group's prefix, in passes of about `rows`
    rows; yield `((group, row), logprobs, greedy)` for each row, over its tokens (0 and
    `False` before its `first`).

    The prefix's last token is read with the rows: the prefix pass writes the cache of the
    others only, and needs no logits (XLA drops its head). A pass holds `g` groups of `n`
    rows each, `n` the power of two that holds the pass's largest group and `g = rows //
    n` (at least 1); a group of more than `rows` rows is split. The caller orders the
    groups (longest prefix first keeps the buckets tight); `on_pass(n)` is called after
    each pass with the number of real rows it held.
    """
    parts = []  # (group index, first row index, rows)
    for g, group in enumerate(groups):
        for begin in range(0, len(group.rows), rows):
            parts.append((g, begin, group.rows[begin : begin + rows]))
    begin = 0
    while begin < len(parts):
        width = 1 << (len(parts[begin][2]) - 1).bit_length()
        count = 1
        while begin + count < len(parts):
            wider = max(width, 1 << (len(parts[begin + count][2]) - 1).bit_length())
            if (count + 1) * wider > rows:
                break
            width, count = wider, count + 1
        n_groups = _round_up(max(1, rows // width), multiple)
        chunk = parts[begin : begin + count]
        begin += count
        yield from _group_pass(model, groups, chunk, n_groups, width, mesh, rules)
        if on_pass is not None:
            on_pass(sum(len(part[2]) for part in chunk))


def _group_pass(model, groups, chunk, n_groups: int, width: int, mesh, rules):
    max_len = model.max_len
    longest_prefix = max(len(groups[g].prefix) - 1 for g, _, _ in chunk)
    p = bucket(longest_prefix, max_len) if longest_prefix else 0
    c = bucket(
        max(len(r.ids) for _, _, part in chunk for r in part), max_len, MIN_CONTINUATION_BUCKET
    )
    prefix = np.zeros((n_groups, p), np.int32)
    starts = np.zeros((n_groups,), np.int32)
    inputs = np.zeros((n_groups, width, c), np.int32)
    targets = np.zeros((n_groups, width, c), np.int32)
    lo = np.zeros((n_groups, width), np.int32)
    hi = np.zeros((n_groups, width), np.int32)
    for j, (g, _, part) in enumerate(chunk):
        context = groups[g].prefix
        starts[j] = len(context) - 1
        prefix[j, : starts[j]] = context[:-1]
        for k, row in enumerate(part):
            n = len(row.ids)
            inputs[j, k, 0] = context[-1]
            inputs[j, k, 1:n] = row.ids[:-1]
            targets[j, k, :n] = row.ids
            lo[j, k], hi[j, k] = row.first, n
    arrays = (prefix, starts, inputs, targets, lo, hi)
    if mesh is not None:
        arrays = shard_batch(arrays, mesh, rules)
    model_arrays, structure = split_model(model)
    out = _group_program(model_arrays, *arrays, structure=structure, mesh=mesh, rules=rules)
    logprobs, greedy = (np.asarray(x) for x in out)
    for j, (g, first_row, part) in enumerate(chunk):
        for k, row in enumerate(part):
            n = len(row.ids)
            yield (g, first_row + k), logprobs[j, k, :n], greedy[j, k, :n]


@functools.partial(jax.jit, static_argnames=("structure", "mesh", "rules"))
def _group_program(arrays, prefix, starts, inputs, targets, lo, hi, *, structure, mesh, rules):
    """Prefill each group's prefix into a cache, then run each of its rows against it.

    `prefix (groups, p)`: every token of the prefix but its last; `starts (groups,)`: how
    many (the cache rows the rows see). `inputs (groups, n, c)`: the prefix's last token,
    then the row's tokens but its last, at positions `starts ..`; `targets`: the row's
    tokens.
    """
    model = rebuild(arrays, structure)
    # Room for the rows' writes too (which nothing reads: XLA drops them).
    rows = min(prefix.shape[1] + inputs.shape[2], model.max_len)

    def prefill(ids):
        cache = model.init_cache(max_len=rows)
        if prefix.shape[1] == 0:
            return cache
        return model.prefill(ids, cache, 0, check=False)[1]

    caches = constrain(jax.vmap(prefill)(prefix), mesh, rules)
    # Unbatched bounds, so that the cache's chunk skips stay skips under vmap.
    bound, low = jnp.max(starts), jnp.min(starts)

    def row(cache, start, ids):
        return model.prefill(ids, cache, start, check=False, kv_bound=bound, kv_low=low)[0]

    logits = jax.vmap(jax.vmap(row, in_axes=(None, None, 0)))(caches, starts, inputs)
    return constrain(token_scores(logits, targets, lo, hi), mesh, rules)


# -- how many rows fit -------------------------------------------------------------------------


def rows_that_fit(model, width: int, *, limit: int, budget: int | None = None) -> int:
    """The most rows, a power of two at most `limit`, whose plain pass over `width` tokens
    fits in `budget` bytes (default `memory_budget()`).

    Measured, not guessed: the pass is compiled for 1 and 2 rows and XLA's memory analysis
    of each (arguments, outputs and temporaries) gives the fixed bytes (the weights) and
    the bytes per row (activations and the `(width, vocab)` logits). Returns 1 when the
    backend gives no analysis.
    """
    budget = memory_budget() if budget is None else budget
    arrays, structure = split_model(model)

    def nbytes(rows: int) -> int | None:
        ids = jax.ShapeDtypeStruct((rows, width), jnp.int32)
        ends = jax.ShapeDtypeStruct((rows,), jnp.int32)
        lowered = _plain_program.lower(
            arrays, ids, ids, ends, ends, structure=structure, mesh=None, rules=None
        )
        m = lowered.compile().memory_analysis()
        if m is None:
            return None
        return (
            m.argument_size_in_bytes
            + m.output_size_in_bytes
            + m.temp_size_in_bytes
            - m.alias_size_in_bytes
        )

    one, two = nbytes(1), nbytes(2)
    if one is None or two is None:
        return 1
    per_row = max(two - one, 1)
    fits = max(1, (budget - (one - per_row)) // per_row)
    rows = 1
    while rows * 2 <= min(fits, limit):
        rows *= 2
    return rows


def memory_budget(device=None) -> int:
    """Bytes a pass may use on `device` (default JAX's first): 90% of what an accelerator
    has free (`memory_stats`), or on a CPU half of the host's available memory
    (`MemAvailable` of /proc/meminfo; 4 GiB where there is none)."""
    device = jax.devices()[0] if device is None else device
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        return int(0.9 * (stats["bytes_limit"] - stats.get("bytes_in_use", 0)))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 // 2
    except OSError:
        pass
    return 4 * 2**30


# -- buckets and checks ------------------------------------------------------------------------


def bucket(n: int, cap: int, minimum: int = MIN_BUCKET) -> int:
    """The smallest power of two `>= max(n, minimum)`, at most `cap` (`n <= cap`)."""
    return min(max(minimum, 1 << (max(n, 1) - 1).bit_length()), cap)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _row_multiple(mesh, rules) -> int:
    """The rows of a pass must split evenly over the `batch` rule's mesh axis."""
    if rules is not None and mesh is None:
        raise ValueError("rules say how to place arrays on a mesh; pass mesh= too.")
    if mesh is None:
        return 1
    return mesh_size(mesh, (ShardingRules() if rules is None else rules).batch)


UNDER_JIT = (
    "score got a traced {name}: it was called inside jax.jit, jax.vmap or eqx.filter_jit. "
    "score plans its passes on the host and compiles them itself, so call it outside any "
    "transformation."
)


def _check(model, tokens, prompt_lengths, lengths, prefix, window, stride, batch_size):
    """The checked arguments of `score`, as NumPy arrays and ints."""
    for name, value in (
        ("tokens", tokens),
        ("prompt_lengths", prompt_lengths),
        ("lengths", lengths),
        ("prefix", prefix),
    ):
        if not is_concrete(value):
            raise TypeError(UNDER_JIT.format(name=name))
    max_len, vocab = getattr(model, "max_len", None), getattr(model, "vocab_size", None)
    for name, value in (("max_len", max_len), ("vocab_size", vocab)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise TypeError(
                f"score needs a model with an integer `{name}` attribute (a causal model "
                f"`ids -> logits` such as eqrope.RotaryDecoder); got {type(model).__name__}."
            )
    ids = np.asarray(
        as_int_array(tokens, "tokens", ndim=(1, 2), hint=" Use (seq,) or (batch, seq).")
    )
    ids = ids[None] if ids.ndim == 1 else ids
    batch, seq = ids.shape
    if batch == 0 or seq == 0:
        raise ValueError(f"tokens is empty (shape {np.shape(tokens)}); pass at least one token.")
    lengths = _per_row(lengths, "lengths", batch, seq)
    if ((lengths < 1) | (lengths > seq)).any():
        raise ValueError(
            f"lengths must be in [1, {seq}] (the width of tokens), got {lengths.tolist()}."
        )
    if prefix is not None:
        if not has_cache_protocol(model):
            raise TypeError(
                "prefix= prefills the prefix into a cache once; it needs a model with the cache "
                "protocol (init_cache, prefill), such as eqrope.RotaryDecoder, not "
                f"{type(model).__name__}."
            )
        prefix = np.asarray(
            as_int_array(prefix, "prefix", ndim=1, hint=" One prefix for every row.")
        )
        if prefix.shape[0] == 0:
            raise ValueError("prefix is empty; pass at least one token, or prefix=None.")
        check_vocab(prefix, vocab, "prefix")
        if stride is not None:
            raise ValueError(
                "stride= scores rows in rolling windows; it cannot be combined with prefix=."
            )
    minimum = 0 if prefix is not None else 1
    firsts = _per_row(
        minimum if prompt_lengths is None else prompt_lengths, "prompt_lengths", batch, seq
    )
    if (firsts < minimum).any():
        if prefix is not None:
            raise ValueError(f"prompt_lengths must be >= 0, got {firsts.tolist()}.")
        raise ValueError(
            f"prompt_lengths must be >= 1, got {firsts.tolist()}: the first token has nothing "
            "before it to be scored from. Start each row with a BOS token, or pass prefix=."
        )
    empty = np.flatnonzero(firsts >= lengths)
    if empty.size:
        i = int(empty[0])
        raise ValueError(
            f"row {i} has an empty continuation: prompt_lengths[{i}]={firsts[i]} >= "
            f"lengths[{i}]={lengths[i]}, so no token is scored. Every row must score at "
            "least one token."
        )
    real = np.arange(seq)[None, :] < lengths[:, None]
    check_vocab(ids, vocab, "tokens", valid=real)
    window = max_len if window is None else check_int(window, "window", minimum=1)
    if window > max_len:
        raise ValueError(
            f"window={window}, but the model's max_len is {max_len}; pass at most {max_len}."
        )
    if stride is not None:
        stride = check_int(stride, "stride", minimum=1)
        if stride > window:
            raise ValueError(
                f"stride={stride} > window={window} would skip tokens; pass 1 <= stride <= window."
            )
    reach = lengths - 1 + (0 if prefix is None else prefix.shape[0])
    too_long = np.flatnonzero(reach > window)
    if too_long.size and (stride is None or prefix is not None):
        i = int(too_long[0])
        if prefix is not None:
            raise ValueError(
                f"the prefix and row {i} hold {reach[i] + 1} tokens, more than window + 1 = "
                f"{window + 1} (one pass reads at most window tokens; the last token is only "
                "predicted). Shorten the prefix or the row."
            )
        raise ValueError(
            f"row {i} has {reach[i] + 1} tokens (lengths[{i}]), but one pass reads at most "
            f"window={window} tokens, plus the last, which is only predicted. Pass stride=... "
            "to score long rows in rolling windows (stride=window is lm-eval's "
            "loglikelihood_rolling), or shorten the row."
        )
    batch_size = check_int(batch_size, "batch_size", minimum=1, none=True)
    return ids, lengths, firsts, prefix, window, stride, batch_size


def _per_row(value, name: str, batch: int, seq: int) -> np.ndarray:
    """`value` (None, an int, or one int per row) as a `(batch,)` int array."""
    if value is None:
        return np.full((batch,), seq, np.int32)
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        return np.full((batch,), check_int(value, name), np.int32)
    values = np.asarray(as_int_array(value, name, ndim=(0, 1)))
    if values.ndim == 0:
        return np.full((batch,), int(values), np.int32)
    if values.shape[0] != batch:
        raise ValueError(f"{name} has {values.shape[0]} entries but tokens has {batch} rows.")
    return values
