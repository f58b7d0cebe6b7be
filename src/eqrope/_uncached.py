"""The uncached reference loop: the whole text runs through the model for every token.

It is the documented reference path of [`eqrope.generate`][], for any causal callable
`ids -> logits` with a `max_len`. Python loops over rows and tokens; each forward pass is
compiled once per padded width, not once per length.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._decode import NON_FINITE
from ._generate_args import Request
from ._sampling import sample_token


@eqx.filter_jit
def _last_logits(model, ids, index):
    return model(ids)[index].astype(jnp.float32)


_sample = jax.jit(sample_token)


def uncached_bucket(length: int, max_len: int) -> int:
    """The padded width the uncached path runs a text of `length` tokens at.

    The next power of two (at least 16), capped at `max_len`: at most twice the text, and
    about `log2(max_len)` compiled shapes instead of one per length.
    """
    return min(max(16, 1 << (length - 1).bit_length()), max_len)


def generate_uncached(
    model, request: Request, check_finite: bool = True
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The reference loop, with the same sampling and keys as the cached program.

    The text is padded on the right to `uncached_bucket` tokens; a causal model's logits
    at the last real token do not see the pads. Nothing is reused between tokens.

    **Returns:** `(tokens, logprobs, ends)` as NumPy arrays, laid out as the cached
    program's.
    """
    batch, max_len = request.prompt.shape[0], request.max_len
    tokens = np.zeros((batch, max_len), np.int32)
    logprobs = np.zeros((batch, max_len), np.float32)
    ends = np.zeros((batch,), np.int32)
    eos = set(np.asarray(request.sampling.eos).tolist())
    keys = jax.random.split(request.key, batch) if request.batched else request.key[None]
    for r in range(batch):
        text = [int(t) for t in request.prompt[r, : request.lengths[r]]]
        tokens[r, : len(text)] = text
        for _ in range(request.max_new):
            if len(text) >= max_len:
                break
            pos = len(text)
            padded = np.zeros((uncached_bucket(pos, max_len),), np.int32)
            padded[:pos] = text
            logits = _last_logits(model, jnp.asarray(padded), jnp.asarray(pos - 1, jnp.int32))
            if check_finite and not np.isfinite(np.asarray(logits)).all():
                raise FloatingPointError(NON_FINITE)
            tok, lp = _sample(logits, keys[r], np.asarray(pos, np.int32), request.sampling)
            text.append(int(tok))
            tokens[r, pos], logprobs[r, pos] = int(tok), float(lp)
            if int(tok) in eos:
                break
        ends[r] = len(text)
    return tokens, logprobs, ends
