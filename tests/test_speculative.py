"""Speculative decoding (`generate(..., draft=...)`) against plain decoding.

Every check compares with something independent of the speculative program: plain
`generate` (its own loop, one model step per token), the uncached reference path, a
hand-written n-gram lookup, or the counts a round must give by construction.
"""

import json
import math
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

import eqrope
from eqrope.generation.speculative._prompt_lookup import PromptLookup, lookup_draft
from eqrope.testing import Uncached

from _compiles import counting
from _models import random_model


def perturbed(model, scale: float, seed: int):
    """`model` with Gaussian noise of `scale` times each array's spread: a draft close to
    the target, so that it keeps some drafts and loses others."""
    rng = np.random.default_rng(seed)

    def noisy(x):
        if not eqx.is_inexact_array(x):
            return x
        return x + scale * float(jnp.std(x) + 1e-3) * jnp.asarray(rng.normal(size=x.shape), x.dtype)

    return jax.tree.map(noisy, model)


@pytest.fixture(scope="module")
def target():
    return random_model(0, 32, 32, 4, 2, 128)


@pytest.fixture(scope="module")
def drafts(target):
    """A close draft, a random small one (rejects nearly everything), the target itself."""
    return {
        "close": perturbed(target, 0.15, 1),
        "small": random_model(2, 32, 16, 2, 1, 128),
        "self": target,
        "lookup": "prompt_lookup",
    }


def ragged(seed: int, vocab: int = 32):
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, vocab, (4, 12)).astype(np.int32)
    # Repeats in the prompts give prompt lookup something to find.
    prompt[:, 6:12] = prompt[:, 0:6]
    return prompt, np.array([12, 1, 7, 9], np.int32)


def ragged_settings(lengths) -> dict:
    """The ragged batch's settings: its lengths, an EOS, a stop sequence and a penalty.
    Tests that call `generate` with them, 40 new tokens and `return_logprobs=True` share
    the compiled programs of `test_greedy_equals_plain_on_a_ragged_batch`."""
    return dict(prompt_lengths=lengths, eos_id=[3], stop=[[5, 6]], repetition_penalty=1.3, return_logprobs=True)


# -- greedy: the tokens of plain decoding ----------------------------------------------------


@pytest.mark.parametrize("name", ["close", "small", "self", "lookup"])
@pytest.mark.parametrize("draft_len", [1, 3, 5])
def test_greedy_equals_plain_on_a_ragged_batch(target, drafts, name, draft_len):
    prompt, lengths = ragged(draft_len)
    plain = eqrope.generate(target, prompt, 40, **ragged_settings(lengths))
    fast = eqrope.generate(target, prompt, 40, draft=drafts[name], draft_len=draft_len, **ragged_settings(lengths))
    np.testing.assert_array_equal(fast.tokens, plain.tokens)
    np.testing.assert_array_equal(fast.lengths, plain.lengths)
    np.testing.assert_allclose(fast.logprobs, plain.logprobs, atol=2e-5)
    np.testing.assert_allclose(fast.model_logprobs, plain.model_logprobs, atol=2e-5)
    new = np.asarray(plain.lengths) - lengths
    steps, accepted = np.asarray(fast.target_steps), np.asarray(fast.accepted)
    np.testing.assert_array_equal(plain.target_steps, new)
    # Each round adds 1 to draft_len + 1 tokens.
    assert np.all(steps <= new) and np.all(steps >= np.ceil(new / (draft_len + 1)))
    drafted = np.asarray(fast.drafted)
    assert np.all(drafted <= draft_len * steps) and np.all(accepted <= drafted)
    # A round offers fewer than draft_len drafts only when fewer tokens remain; those
    # rounds see distinct remainders (each adds a token), so they miss at most 1 + ... + (k-1).
    assert np.all(drafted >= draft_len * steps - draft_len * (draft_len - 1) // 2)
    # A round's tokens are its kept drafts, then one more unless a kept draft ended the row.
    slack = accepted - (new - steps)
    assert np.all((slack == 0) | (slack == 1)), slack


def test_greedy_equals_the_uncached_path(target, drafts):
    prompt, lengths = ragged(7)
    reference = eqrope.generate(Uncached(target), prompt, 40, **ragged_settings(lengths))
    fast = eqrope.generate(target, prompt, 40, draft=drafts["close"], draft_len=3, **ragged_settings(lengths))
    np.testing.assert_array_equal(fast.tokens, reference.tokens)


def test_the_close_draft_keeps_some_drafts_and_loses_others(target, drafts):
    """The tests above exercise both outcomes of a round, not one."""
    prompt, lengths = ragged(3)
    fast = eqrope.generate(
        target, prompt, 40, prompt_lengths=lengths, draft=drafts["close"], return_logprobs=True
    )
    assert 0.2 < fast.acceptance < 0.95, fast.acceptance


CHECKPOINTS = Path(__file__).resolve().parents[1] / "bench" / "checkpoints" / "speculative"


def test_greedy_with_a_trained_draft_equals_plain_and_uncached():
    """bench/speculative.py's pair: a 4-block width-256 target and a 1-block width-64
    draft, trained on the same character-level language."""
    target, draft = eqrope.load(CHECKPOINTS / "target"), eqrope.load(CHECKPOINTS / "draft")
    vocab = json.loads((CHECKPOINTS / "train.json").read_text())["vocab"]
    texts = ["the ", "a bird", "t", "the teacher paints a"]
    prompt = np.zeros((len(texts), max(map(len, texts))), np.int32)
    for row, text in enumerate(texts):
        prompt[row, : len(text)] = [vocab.index(c) for c in text]
    lengths = np.array([len(t) for t in texts], np.int32)
    settings = dict(prompt_lengths=lengths, max_len=64)
    plain = eqrope.generate(target, prompt, 40, **settings)
    uncached = eqrope.generate(Uncached(target), prompt, 40, **settings)
    fast = eqrope.generate(target, prompt, 40, draft=draft, draft_len=4, return_logprobs=True, **settings)
    np.testing.assert_array_equal(fast.tokens, plain)
    np.testing.assert_array_equal(fast.tokens, uncached)
    assert 0.5 < fast.acceptance < 1, fast.acceptance
    assert np.all(np.asarray(fast.target_steps) < 40)


# -- with the target as its own draft ---------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("draft_len", [2, 4])
def test_self_draft_accepts_everything(target, draft_len, temperature):
    max_new = 6 * (draft_len + 1) + 1  # the last round is cut short by max_new
    prompt, _ = ragged(1)
    fast = eqrope.generate(
        target, prompt, max_new, draft=target, draft_len=draft_len, temperature=temperature,
        key=jax.random.key(5), return_logprobs=True,
    )  # fmt: skip
    np.testing.assert_array_equal(fast.accepted, fast.drafted)
    assert np.all(np.asarray(fast.target_steps) <= math.ceil(max_new / (draft_len + 1)) + 1)
    np.testing.assert_array_equal(fast.lengths, 12 + max_new)


# -- sampling: exact in distribution ----------------------------------------------------------


SETTINGS = {
    "plain": dict(temperature=1.0),
    "top_k": dict(temperature=0.8, top_k=3),
    "top_p": dict(temperature=1.2, top_p=0.7),
    "min_p": dict(temperature=1.0, min_p=0.15, repetition_penalty=1.5),
}


def _first_three(tokens, start: int, vocab: int) -> np.ndarray:
    t = np.asarray(tokens)[:, start : start + 3].astype(np.int64)
    return (t[:, 0] * vocab + t[:, 1]) * vocab + t[:, 2]


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("name", ["near", "far", "lookup"])
def test_sampling_matches_plain_sampling(name, setting):
    """20,000 draws of the first 3 new tokens (vocab 5: 125 outcomes), speculative with the
    residual rule against plain sampling with other keys: a chi-square test of
    homogeneity, outcomes with fewer than 5 expected draws pooled."""
    vocab, n = 5, 20_000
    target = random_model(10, vocab, 16, 2, 1, 32)
    draft = {
        "near": perturbed(target, 0.3, 11),
        "far": random_model(12, vocab, 16, 2, 1, 32),
        "lookup": "prompt_lookup",
    }[name]
    prompt = np.tile(np.array([1, 2, 1, 2], np.int32), (n, 1))
    settings = SETTINGS[setting]
    plain = eqrope.generate(target, prompt, 3, key=jax.random.key(0), **settings)
    fast = eqrope.generate(
        target, prompt, 3, key=jax.random.key(1), draft=draft, draft_len=2, return_logprobs=True,
        **settings,
    )  # fmt: skip
    a = np.bincount(_first_three(plain, 4, vocab), minlength=vocab**3)
    b = np.bincount(_first_three(fast.tokens, 4, vocab), minlength=vocab**3)
    expected = (a + b) / 2
    rare = expected < 5
    table = np.stack([np.append(a[~rare], a[rare].sum()), np.append(b[~rare], b[rare].sum())])
    table = table[:, table.sum(0) > 0]
    p = scipy.stats.chi2_contingency(table)[1]
    assert p > 0.01, (p, fast.acceptance)
    # The drafts were judged, not all accepted nor all rejected (but for the far draft).
    assert 0 < fast.acceptance < 1 or name == "far"


@pytest.mark.parametrize("name", ["close", "small", "lookup"])
def test_coupled_rule_gives_plain_generates_text_for_the_same_key(target, drafts, name):
    prompt, lengths = ragged(11)
    settings = dict(temperature=1.1, top_k=12, top_p=0.95, presence_penalty=0.5, prompt_lengths=lengths)
    key = jax.random.key(42)
    plain = eqrope.generate(target, prompt, 30, key=key, return_logprobs=True, **settings)
    fast = eqrope.generate(
        target, prompt, 30, key=key, draft=drafts[name], accept="coupled", return_logprobs=True,
        **settings,
    )  # fmt: skip
    np.testing.assert_array_equal(fast.tokens, plain.tokens)
    np.testing.assert_allclose(fast.logprobs, plain.logprobs, atol=2e-5)
    if name == "close":
        assert fast.acceptance > 0.2


def test_coupled_rule_with_num_samples(target, drafts):
    prompt, _ = ragged(2)
    key = jax.random.key(8)
    settings = dict(temperature=1.0, num_samples=3, key=key)
    plain = eqrope.generate(target, prompt[:2], 16, **settings)
    fast = eqrope.generate(target, prompt[:2], 16, draft=drafts["close"], accept="coupled", **settings)
    assert fast.shape == (2, 3, 28)
    np.testing.assert_array_equal(fast, plain)


def test_on_token_sees_the_tokens_of_plain_decoding(target, drafts):
    prompt, lengths = ragged(4)
    seen = {"plain": [], "fast": []}
    for name, draft in (("plain", None), ("fast", drafts["close"])):
        eqrope.generate(
            target, prompt, 20, prompt_lengths=lengths, draft=draft,
            on_token=lambda r, p, t, name=name: seen[name].append((r, p, t)),
        )  # fmt: skip
    assert sorted(seen["fast"]) == sorted(seen["plain"])
    for row in range(4):  # each row's tokens come in order
        positions = [p for r, p, _ in seen["fast"] if r == row]
        assert positions == sorted(positions)


# -- one program per (cache length, draft_len) -------------------------------------------------


def test_one_compile_per_cache_length_and_draft_len(target, drafts):
    prompt, lengths = ragged(5)
    call = lambda **kw: eqrope.generate(target, prompt, max_len=64, draft=drafts["close"], **kw)
    call(max_new=10, prompt_lengths=lengths)
    with counting() as c:
        call(max_new=30, prompt_lengths=lengths[::-1].copy())
        call(max_new=5, prompt_lengths=lengths, temperature=0.7, key=jax.random.key(1), top_p=0.9)
        call(max_new=12, prompt_lengths=lengths, accept="residual", repetition_penalty=1.2)
        eqrope.generate(target, prompt[:, :9], 20, max_len=64, draft=drafts["close"], prompt_lengths=np.minimum(lengths, 9))
    assert c.traces["speculative_program"] == 0, dict(c.traces)
    with counting() as c:
        call(max_new=10, prompt_lengths=lengths, draft_len=2)
    assert c.traces["speculative_program"] == 1, dict(c.traces)


# -- prompt lookup -----------------------------------------------------------------------------


def reference_lookup(text: list[int], draft_len: int, max_ngram: int, min_ngram: int) -> list[int]:
    """The lookup by hand: the longest suffix (at most `max_ngram`) found earlier, its most
    recent occurrence, and the tokens after it, the draft continuing itself."""
    for n in range(min(max_ngram, len(text) - 1), min_ngram - 1, -1):
        suffix = text[len(text) - n :]
        for start in range(len(text) - n - 1, -1, -1):
            if text[start : start + n] == suffix:
                out = list(text)
                for i in range(draft_len):
                    out.append(out[start + n + i])
                return out[len(text) :]
    return [text[-1]] * draft_len


@pytest.mark.parametrize("seed", range(6))
def test_prompt_lookup_matches_a_hand_written_lookup(seed):
    rng = np.random.default_rng(seed)
    lookup = PromptLookup(max_ngram=3, min_ngram=1 + seed % 2)
    for _ in range(30):
        length = int(rng.integers(1, 20))
        text = rng.integers(0, 4, length).tolist()
        tokens = np.zeros((32,), np.int32)
        tokens[:length] = text
        got = lookup_draft(jnp.asarray(tokens), jnp.asarray(length, jnp.int32), 5, lookup)
        want = reference_lookup(text, 5, lookup.max_ngram, lookup.min_ngram)
        assert np.asarray(got).tolist() == want, (text, lookup)


# -- refusals ----------------------------------------------------------------------------------


def test_bad_draft_arguments_are_refused_by_name(target, drafts):
    prompt = np.arange(5, dtype=np.int32)
    with pytest.raises(ValueError, match="draft_len=3 sets up speculative decoding"):
        eqrope.generate(target, prompt, 4, draft_len=3)
    with pytest.raises(ValueError, match="accept must be one of"):
        eqrope.generate(target, prompt, 4, draft=drafts["close"], accept="leviathan")
    with pytest.raises(ValueError, match="'prompt_lookup'"):
        eqrope.generate(target, prompt, 4, draft="ngram")
    with pytest.raises(ValueError, match="vocab_size is 40"):
        eqrope.generate(target, prompt, 4, draft=random_model(0, 40, 16, 2, 1, 128))
    with pytest.raises(ValueError, match="draft's max_len is 16"):
        eqrope.generate(target, prompt, 30, draft=random_model(0, 32, 16, 2, 1, 16))
    with pytest.raises(ValueError, match="draft_len=16 verifies 17 positions"):
        eqrope.generate(target, prompt, 4, draft="prompt_lookup", draft_len=16)
    with pytest.raises(ValueError, match="draft_len must be"):
        eqrope.generate(target, prompt, 4, draft="prompt_lookup", draft_len=0)
    with pytest.raises(ValueError, match="no cache protocol"):
        eqrope.generate(Uncached(target), prompt, 4, draft="prompt_lookup")
    with pytest.raises(TypeError, match="cache protocol"):
        eqrope.generate(target, prompt, 4, draft=Uncached(target))
    with pytest.raises(ValueError, match="min_ngram must be at most max_ngram"):
        PromptLookup(max_ngram=2, min_ngram=3)


def test_a_draft_with_nan_weights_raises(target):
    # The close draft's shapes and the ragged batch's settings: the program of
    # test_greedy_equals_plain_on_a_ragged_batch[3-close], not one of its own.
    broken = eqx.tree_at(lambda m: m.head_bias, target, jnp.full_like(target.head_bias, jnp.nan))
    prompt, lengths = ragged(3)
    with pytest.raises(FloatingPointError, match="draft model gave non-finite logits"):
        eqrope.generate(target, prompt, 40, draft=broken, draft_len=3, **ragged_settings(lengths))


def test_draft_under_grad_is_refused(target, drafts):
    def loss(model):
        out = eqrope.generate(model, np.arange(5, dtype=np.int32), 4, draft=drafts["close"], return_logprobs=True)
        return out.logprobs.sum()

    with pytest.raises(ValueError, match="jax.grad cannot differentiate"):
        eqx.filter_grad(loss)(target)


@pytest.mark.usefixtures("precision")
def test_x64_mode(target, drafts):
    # The ragged batch's settings: in x32 mode, the programs of
    # test_greedy_equals_plain_on_a_ragged_batch[3-close].
    prompt, lengths = ragged(9)
    plain = eqrope.generate(target, prompt, 40, **ragged_settings(lengths))
    fast = eqrope.generate(target, prompt, 40, draft=drafts["close"], draft_len=3, **ragged_settings(lengths))
    np.testing.assert_array_equal(fast.tokens, plain.tokens)
