"""`check_logits` (the decode loop's non-finite check) against NumPy's `isfinite`."""

import jax
import jax.numpy as jnp
import numpy as np

from eqrope.generation._processors import History
from eqrope.generation._state import check_logits, start_text


def test_rows_with_a_nan_or_an_infinity_stop_flagged_and_only_active_ones():
    rows, vocab = 8, 48
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(rows, vocab)).astype(np.float32) * 30
    logits[1, 5] = np.nan
    logits[2, 0] = np.inf
    logits[3, -1] = -np.inf
    logits[4] = np.nan  # every entry
    logits[5, [3, 9]] = [np.inf, -np.inf]
    logits[6, 7] = np.nan  # inactive: not flagged
    logits[7] = np.finfo(np.float32).max  # large but finite
    active = np.array([True, True, True, True, True, True, False, True])
    history = History(jnp.zeros((rows, vocab), bool), jnp.zeros((rows, vocab), jnp.int32))
    text = start_text(jnp.zeros((rows, 16), jnp.int32), jnp.full((rows,), 4), history, jnp.full((rows,), 3))

    checked, still = jax.jit(check_logits)(text, jnp.asarray(logits), jnp.asarray(active))

    bad = active & ~np.isfinite(logits).all(axis=-1)
    assert bad.tolist() == [False, True, True, True, True, True, False, False]
    np.testing.assert_array_equal(np.asarray(checked.nonfinite), bad)
    np.testing.assert_array_equal(np.asarray(checked.done), bad)
    np.testing.assert_array_equal(np.asarray(still), active & ~bad)
