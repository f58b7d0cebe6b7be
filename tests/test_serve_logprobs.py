"""The server's `token_logprobs` against independent references.

- each chosen token's log-probability against `eqrope.score` on the same ids;
- the top-k ids and log-probabilities against a NumPy float64 `log_softmax` of the logits
  of `model(ids)` (no padding, no bucket), sorted stably by descending log-probability;
- a bfloat16 model still returns float32, close to `eqrope.score`;
- one compile per (length bucket, `max_k`): a new `k` or a new length within the bucket
  compiles nothing, counted from `jax.monitoring`;
- the errors, each naming its argument.

Every test runs with and without `jax_enable_x64`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqrope
from _compiles import counting
from _models import random_model
from eqrope.serving.server._logprobs import TokenLogprobs, token_logprobs


pytestmark = pytest.mark.usefixtures("precision")

VOCAB, MAX_LEN, MAX_K = 61, 64, 5


@pytest.fixture(scope="module")
def model():
    return random_model(0, VOCAB, 32, 4, 2, MAX_LEN, n_kv_heads=2)


def _ids(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, n).astype(np.int32)


def _reference_top(model, ids: np.ndarray, start: int, k: int):
    """The top `k` at positions `start .. n - 1`, from float64 log-softmaxed logits."""
    logits = np.asarray(model(jnp.asarray(ids)), np.float64)[start - 1 : len(ids) - 1]
    logprobs = logits - logits.max(-1, keepdims=True)
    logprobs -= np.log(np.exp(logprobs).sum(-1, keepdims=True))
    order = np.argsort(-logprobs, axis=-1, kind="stable")[:, :k]
    return order, np.take_along_axis(logprobs, order, axis=-1)


@pytest.mark.parametrize(("n", "start"), [(2, 1), (9, 4), (40, 1), (MAX_LEN, 33)])
def test_matches_score_and_a_float64_reference(model, n, start):
    ids = _ids(n, seed=n)
    out = token_logprobs(model, list(map(int, ids)), start, 3, max_k=MAX_K)
    assert isinstance(out, TokenLogprobs)
    assert out.logprobs.dtype == np.float32 and out.logprobs.shape == (n - start,)
    assert out.top_ids.dtype == np.int32 and out.top_ids.shape == (n - start, 3)
    assert out.top_logprobs.dtype == np.float32 and out.top_logprobs.shape == (n - start, 3)
    scores = eqrope.score(model, ids)
    np.testing.assert_allclose(out.logprobs, scores.logprobs[start:], rtol=0, atol=1e-5)
    top_ids, top_logprobs = _reference_top(model, ids, start, 3)
    np.testing.assert_array_equal(out.top_ids, top_ids)
    np.testing.assert_allclose(out.top_logprobs, top_logprobs, rtol=0, atol=1e-5)
    # The most likely token is at least as likely as the one there.
    assert (out.top_logprobs[:, 0] >= out.logprobs - 1e-6).all()


def test_k_is_a_prefix_of_max_k(model):
    ids = _ids(20, seed=1)
    full = token_logprobs(model, ids, 1, MAX_K, max_k=MAX_K)
    for k in (0, 1, 4):
        out = token_logprobs(model, ids, 1, k, max_k=MAX_K)
        assert out.top_ids.shape == (19, k) and out.top_logprobs.shape == (19, k)
        np.testing.assert_array_equal(out.top_ids, full.top_ids[:, :k])
        np.testing.assert_array_equal(out.top_logprobs, full.top_logprobs[:, :k])
        np.testing.assert_array_equal(out.logprobs, full.logprobs)
    assert (np.diff(full.top_logprobs, axis=-1) <= 0).all()


def test_start_at_the_end_scores_nothing(model):
    out = token_logprobs(model, _ids(1), 1, 2, max_k=MAX_K)
    assert out.logprobs.shape == (0,) and out.top_ids.shape == (0, 2)
    assert out.top_logprobs.shape == (0, 2)


def test_a_bfloat16_model_scores_in_float32(model):
    low = jax.tree.map(
        lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x, model
    )
    ids = _ids(12, seed=2)
    out = token_logprobs(low, ids, 1, 2, max_k=2)
    assert out.logprobs.dtype == np.float32 and out.top_logprobs.dtype == np.float32
    np.testing.assert_allclose(out.logprobs, eqrope.score(low, ids).logprobs[1:], atol=1e-5)


def test_one_compile_per_bucket_and_max_k(model):
    max_k = 7  # no other test uses it, so its programs are this test's own
    with counting() as c:
        token_logprobs(model, _ids(20), 1, 2, max_k=max_k)  # bucket 32 (19 tokens read)
    assert c.traces["logprobs_program"] == 1, dict(c.traces)
    with counting() as c:
        for n, start, k in [(18, 1, 0), (33, 5, max_k), (25, 24, 1), (30, 3, 3)]:
            token_logprobs(model, _ids(n, seed=n), start, k, max_k=max_k)
    assert sum(c.compiles.values()) == 0, dict(c.compiles)
    assert c.traces["logprobs_program"] == 0, dict(c.traces)
    with counting() as c:
        token_logprobs(model, _ids(20), 1, 2, max_k=max_k + 1)  # a new max_k
        token_logprobs(model, _ids(40), 1, 2, max_k=max_k)  # a new bucket (64)
    assert c.traces["logprobs_program"] == 2, dict(c.traces)


@pytest.mark.parametrize(
    ("ids", "start", "k", "max_k", "name"),
    [
        (list(range(5)), 0, 1, 2, "start"),
        (list(range(5)), 6, 1, 2, "start"),
        (list(range(5)), 1, 3, 2, "k"),
        (list(range(5)), 1, -1, 2, "k"),
        (list(range(5)), 1, 1, VOCAB + 1, "max_k"),
        ([0, VOCAB, 1], 1, 1, 2, "ids"),
        ([0, -1, 1], 1, 1, 2, "ids"),
        ([i % VOCAB for i in range(MAX_LEN + 1)], 1, 1, 2, "ids"),
        ([], 1, 1, 2, "ids"),
    ],
)
def test_bad_arguments_raise_naming_them(model, ids, start, k, max_k, name):
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        token_logprobs(model, ids, start, k, max_k=max_k)
