"""`generate`'s log-probabilities against a plain forward pass, by hand under top-k and
top-p, and their gradient against the gradient of recomputed ones.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqrope
from _generate_model import VOCAB, assert_close, full, make_model, random_ids


@pytest.fixture(scope="module")
def model():
    return make_model(0)


def recomputed_logprobs(model, tokens, start, temperature=1.0):
    """log p(tokens[t] | tokens[:t]) for t >= start, from one plain forward pass."""
    logits = full(model, tokens[:-1]).astype(jnp.float32) / temperature
    logp = jax.nn.log_softmax(logits, axis=-1)
    t = jnp.arange(start, tokens.shape[0])
    return logp[t - 1, tokens[t]]


@pytest.mark.parametrize("temperature", [0.0, 1.0, 2.0])
def test_logprobs_equal_a_plain_forward_pass(model, temperature):
    prompt = random_ids(12, 5)
    key = jax.random.PRNGKey(2) if temperature > 0 else None
    gen = eqrope.generate(model, prompt, 8, temperature=temperature, key=key, return_logprobs=True)
    assert isinstance(gen, eqrope.Generation)
    np.testing.assert_array_equal(
        np.asarray(gen.tokens),
        np.asarray(eqrope.generate(model, prompt, 8, temperature=temperature, key=key)),
    )
    assert int(gen.lengths) == 13 and gen.logprobs.shape == (13,)
    assert_close(gen.logprobs[:5], np.zeros(5), atol=0)
    # Greedy reports the model's own log-probabilities (temperature 1).
    want = recomputed_logprobs(model, gen.tokens, 5, temperature if temperature > 0 else 1.0)
    assert_close(gen.logprobs[5:], want)


@pytest.mark.parametrize(
    "temperature, top_k, top_p", [(1.5, 3, None), (1.0, None, 0.7), (0.8, 6, 0.9)]
)
def test_logprobs_under_top_k_and_top_p_by_hand(model, temperature, top_k, top_p):
    """The log-probability of each token under the distribution it was sampled from:
    logits / temperature, restricted to the top k, then to the nucleus, renormalised."""
    prompt = random_ids(12, 5)
    gen = eqrope.generate(
        model,
        prompt,
        8,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        key=jax.random.PRNGKey(3),
        return_logprobs=True,
    )
    logits = np.asarray(full(model, gen.tokens[:-1]), np.float64) / temperature
    for t in range(5, 13):
        row = logits[t - 1]
        keep = np.ones(VOCAB, bool)
        if top_k is not None:
            keep &= row >= np.sort(row)[-top_k]
        if top_p is not None:
            probs = np.where(keep, np.exp(row - row.max()), 0.0)
            probs /= probs.sum()
            order = np.argsort(-probs)
            mass_before = np.cumsum(probs[order]) - probs[order]
            nucleus = np.zeros(VOCAB, bool)
            nucleus[order[mass_before < top_p]] = True
            keep &= nucleus
        token = int(gen.tokens[t])
        assert keep[token]
        kept = row[keep]
        want = row[token] - (kept.max() + np.log(np.sum(np.exp(kept - kept.max()))))
        assert abs(float(gen.logprobs[t]) - want) < 1e-5


def test_grad_of_logprobs_equals_grad_of_recomputed_logprobs(model):
    prompt = random_ids(13, 4)
    for kwargs in (dict(temperature=1.0, key=jax.random.PRNGKey(4)), dict()):
        tokens = eqrope.generate(model, prompt, 6, **kwargs)

        def through_generate(m, kwargs=kwargs):
            return eqrope.generate(m, prompt, 6, return_logprobs=True, **kwargs).logprobs.sum()

        def recomputed(m, tokens=tokens):  # the same tokens, held fixed
            return recomputed_logprobs(m, tokens, 4).sum()

        value, grads = eqx.filter_value_and_grad(through_generate)(model)
        want_value, want = eqx.filter_value_and_grad(recomputed)(model)
        assert_close(value, want_value)
        leaves, want_leaves = jax.tree.leaves(grads), jax.tree.leaves(want)
        assert (
            len(leaves)
            == len(want_leaves)
            == len(jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)))
        )
        assert max(float(jnp.max(jnp.abs(g))) for g in want_leaves) > 1e-2  # not all zero
        for g, w in zip(leaves, want_leaves, strict=True):
            assert_close(g, w, atol=2e-5)


