"""The uncached reference loop: the whole text runs through the model for every token.

It is the documented reference path of [`eqrope.generate`][], for any causal callable
`ids -> logits` with a `max_len`. Python loops over steps and rows; each forward pass is
compiled once per padded width, not once per length. It shares the cached program's
token choice (`choose_token`, each row with its own settings when they are given per
row) and keys, but keeps its own plain bookkeeping: the penalties' history is counted
again from the text at every token, stop sequences are compared as Python lists, and
`num_samples` runs each prompt once per sample.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._request import Request
from ._result import NON_FINITE, Outputs
from ._processors import History
from ._sampling import choose_token, per_row, row_keys
from ._stop_strings import host_ends_with_text
from ._stopping import host_ends_with_stop


@eqx.filter_jit
def _last_logits(model, ids, index):
    return model(ids)[index].astype(jnp.float32)


_choose = jax.jit(choose_token)


def uncached_bucket(length: int, max_len: int) -> int:
    """The padded width the uncached path runs a text of `length` tokens at.

    The next power of two (at least 16), capped at `max_len`: at most twice the text, and
    about `log2(max_len)` compiled shapes instead of one per length.
    """
    return min(max(16, 1 << (length - 1).bit_length()), max_len)


def _history(prompt: list[int], new: list[int], vocab: int) -> History:
    seen = np.zeros((vocab,), np.bool_)
    seen[prompt + new] = True
    counts = np.bincount(np.asarray(new, np.int64), minlength=vocab).astype(np.int32)
    return History(seen, counts)


def generate_uncached(model, request: Request) -> Outputs:
    """The reference loop, with the same sampling and keys as the cached program.

    The text is padded on the right to `uncached_bucket` tokens; a causal model's logits
    at the last real token do not see the pads. Nothing is reused between tokens. Each
    step gives every unfinished row one token, rows in order, so `on_token` is called in
    the cached program's order.

    **Returns:** the `Outputs`, as NumPy arrays laid out as the cached program's.
    """
    rows, max_len, n = request.rows, request.max_len, request.samples or 1
    # Each row's own settings, on the host: the call's, or its row of settings per row.
    sampling = jax.tree.map(np.asarray, request.sampling)
    if per_row(sampling):
        settings = [jax.tree.map(lambda x, r=r: x[r], sampling) for r in range(rows)]
    else:
        settings = [sampling] * rows
    max_new = request.new_tokens()
    tokens = np.zeros((rows, max_len), np.int32)
    logprobs = np.zeros((rows, max_len), np.float32)
    model_logprobs = np.zeros((rows, max_len), np.float32)
    keys = row_keys(request.key, request.prompt.shape[0], request.batched, request.samples)
    prompts = [[int(t) for t in request.prompt[r // n, : request.lengths[r // n]]] for r in range(rows)]
    new: list[list[int]] = [[] for _ in range(rows)]
    going = [len(prompts[r]) < max_len and max_new[r] > 0 for r in range(rows)]
    for _ in range(request.max_new):
        for r in range(rows):
            if not going[r]:
                continue
            sampling = settings[r]
            text = prompts[r] + new[r]
            pos = len(text)
            padded = np.zeros((uncached_bucket(pos, max_len),), np.int32)
            padded[:pos] = text
            logits = _last_logits(model, jnp.asarray(padded), jnp.asarray(pos - 1, jnp.int32))
            if request.check_finite and not np.isfinite(np.asarray(logits)).all():
                raise FloatingPointError(NON_FINITE)
            history = _history(prompts[r], new[r], logits.shape[0])
            n_new = np.int32(len(new[r]))
            tok, lp, own = _choose(logits, history, n_new, keys[r], np.int32(pos), sampling)
            tok = int(tok)
            new[r].append(tok)
            tokens[r, : pos + 1] = text + [tok]
            logprobs[r, pos], model_logprobs[r, pos] = float(lp), float(own)
            if request.stream is not None:
                request.stream(r, pos, tok)
            written = text + [tok]
            ends = (
                tok in np.asarray(sampling.eos).tolist()
                or host_ends_with_stop(written, sampling.stop)
                or host_ends_with_text(written, sampling.stop_text)
            )
            room = pos + 1 < max_len and len(new[r]) < max_new[r]
            going[r] = room and not (n_new >= int(sampling.min_new) and ends)
    for r in range(rows):
        tokens[r, : len(prompts[r])] = prompts[r]
    ends = np.asarray([len(p) + len(t) for p, t in zip(prompts, new)], np.int32)
    return Outputs(tokens, logprobs, model_logprobs, ends)
