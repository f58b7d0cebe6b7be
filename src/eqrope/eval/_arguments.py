"""The checks of `score`'s arguments, in one place: each raises naming the argument and the
fix, and returns the arguments as NumPy arrays and ints; and the rows a mesh splits a pass into.
"""

import numpy as np

from .._checks import as_int_array, check_int, check_vocab, is_concrete, is_int
from ..generation._request_checks import has_cache_protocol
from ..sharding._mesh import mesh_size
from ..sharding._rules import ShardingRules
from ._windows import adapted_rows


def row_multiple(mesh, rules) -> int:
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


def check_arguments(model, tokens, prompt_lengths, lengths, prefix, window, stride, batch_size):
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
        if not is_int(value) or value < 1:
            raise TypeError(
                f"score needs a model with an integer `{name}` attribute (a causal model "
                f"`ids -> logits` such as eqrope.RotaryDecoder); got {type(model).__name__}."
            )
    max_len, vocab = int(max_len), int(vocab)
    ids = np.asarray(
        as_int_array(
            tokens,
            "tokens",
            ndim=(1, 2),
            hint=" Use (seq,) or (batch, seq), each row padded on the right to one width, with "
            "lengths= giving each row's real length.",
        )
    )
    ids = ids[None] if ids.ndim == 1 else ids
    batch, seq = ids.shape
    if batch == 0 or seq == 0:
        raise ValueError(f"tokens is empty (shape {np.shape(tokens)}); pass at least one token.")
    adapted = adapted_rows(model)
    if adapted is not None and adapted != batch:
        raise ValueError(
            f"the model's adapters are chosen for {adapted} rows (eqrope.select_adapters), "
            f"but tokens has {batch}; pass one row of tokens per adapter id, or score with "
            "eqrope.take_adapter(...) for one adapter."
        )
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
    if is_int(value):
        # Range-checked as int32 before the cast (`np.full` would overflow).
        return np.full((batch,), as_int_array(check_int(value, name), name, ndim=0), np.int32)
    values = np.asarray(as_int_array(value, name, ndim=(0, 1)))
    if values.ndim == 0:
        return np.full((batch,), int(values), np.int32)
    if values.shape[0] != batch:
        raise ValueError(f"{name} has {values.shape[0]} entries but tokens has {batch} rows.")
    return values
