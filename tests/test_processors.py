"""Each logits processor against transformers' own `LogitsProcessor`, case by case.

For every processor, 240 random cases (logits, token history, setting), run through
eqrope's function (vmapped over the cases, compiled once) and through transformers' class
(one case at a time, float32 torch): the same tokens are dropped (`-inf`) and the others
agree within 1e-6. The presence and frequency penalties, which transformers lacks, are
checked against OpenAI's formula written out in NumPy.
"""

import functools

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

from eqrope.generation._processors import History, penalize, suppress, truncate
from eqrope.generation._sampling import Sampling, choose_rows, choose_token, logprob_of, process_logits, stack_rows


CASES = 240
VOCAB = 48


def cases(seed: int, *, ties: bool = False):
    """Random logits, prompts and generated tokens (as id lists, with repeats)."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(CASES, VOCAB)) * rng.uniform(0.3, 6.0, size=(CASES, 1))
    if ties:  # coarse values, so that many logits tie
        logits = np.round(logits * 2) / 2
    prompts = [rng.integers(0, VOCAB, rng.integers(1, 12)).tolist() for _ in range(CASES)]
    new = [rng.integers(0, VOCAB // 3, rng.integers(0, 10)).tolist() for _ in range(CASES)]
    return logits.astype(np.float32), prompts, new


def history(prompt, new) -> History:
    seen = np.zeros(VOCAB, bool)
    seen[prompt + new] = True
    return History(seen, np.bincount(np.asarray(new, np.int64), minlength=VOCAB).astype(np.int32))


def stacked(histories) -> History:
    return History(*(np.stack(x) for x in zip(*histories)))


def assert_same(ours, theirs):
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    assert ours.shape == theirs.shape
    np.testing.assert_array_equal(np.isneginf(ours), np.isneginf(theirs))
    finite = np.isfinite(theirs)
    np.testing.assert_allclose(ours[finite], theirs[finite], rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def lp():
    """transformers' logits processors (tests that use them are skipped without it)."""
    pytest.importorskip("transformers")
    return pytest.importorskip("transformers.generation.logits_process")


def hf(processor, ids, logits):
    import torch

    with torch.no_grad():
        scores = processor(torch.tensor([ids], dtype=torch.long), torch.tensor(logits[None]))
    return scores[0].numpy()


@pytest.mark.hf
def test_repetition_penalty_equals_transformers(lp):
    logits, prompts, new = cases(0)
    penalties = np.random.default_rng(1).uniform(0.5, 2.5, CASES).astype(np.float32)
    run = jax.jit(jax.vmap(lambda x, h, p: penalize(x, h, p, 0.0, 0.0)))
    ours = run(logits, stacked(map(history, prompts, new)), penalties)
    for i in range(CASES):
        processor = lp.RepetitionPenaltyLogitsProcessor(float(penalties[i]))
        assert_same(ours[i], hf(processor, prompts[i] + new[i], logits[i]))


def test_presence_and_frequency_penalties_are_openais():
    logits, prompts, new = cases(2)
    rng = np.random.default_rng(3)
    presence, frequency = rng.uniform(-2, 2, (2, CASES)).astype(np.float32)
    run = jax.jit(jax.vmap(lambda x, h, a, b: penalize(x, h, 1.0, a, b)))
    ours = np.asarray(run(logits, stacked(map(history, prompts, new)), presence, frequency))
    for i in range(CASES):
        counts = np.bincount(np.asarray(new[i], np.int64), minlength=VOCAB).astype(np.float32)
        # OpenAI: mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence;
        # the prompt does not count.
        want = logits[i] - counts * frequency[i] - (counts > 0) * presence[i]
        np.testing.assert_allclose(ours[i], want, rtol=1e-6, atol=1e-6)


@pytest.mark.hf
@pytest.mark.parametrize("ties", [False, True])
def test_top_k_equals_transformers(ties, lp):
    logits, _, _ = cases(4, ties=ties)
    ks = np.random.default_rng(5).integers(1, VOCAB + 5, CASES).astype(np.int32)
    ours = jax.jit(jax.vmap(lambda x, k: truncate(x, k, 1.0, 0.0)[0]))(logits, ks)
    for i in range(CASES):
        assert_same(ours[i], hf(lp.TopKLogitsWarper(int(ks[i])), [0], logits[i]))


@pytest.mark.hf
def test_top_p_equals_transformers(lp):
    # Distinct logits: among tokens tied at the nucleus' edge transformers keeps those its
    # sort puts last, eqrope keeps all of them (docs/generation.md).
    logits, _, _ = cases(6)
    ps = np.random.default_rng(7).uniform(0.05, 1.0, CASES).astype(np.float32)
    ours = jax.jit(jax.vmap(lambda x, p: truncate(x, VOCAB, p, 0.0)[0]))(logits, ps)
    for i in range(CASES):
        assert_same(ours[i], hf(lp.TopPLogitsWarper(float(ps[i])), [0], logits[i]))


@pytest.mark.hf
@pytest.mark.parametrize("ties", [False, True])
def test_min_p_equals_transformers(ties, lp):
    logits, _, _ = cases(8, ties=ties)
    ps = np.random.default_rng(9).uniform(0.0, 1.0, CASES).astype(np.float32)
    ps[:20] = [0.0, 1.0] * 10
    ours = jax.jit(jax.vmap(lambda x, p: truncate(x, VOCAB, 1.0, p)[0]))(logits, ps)
    for i in range(CASES):
        assert_same(ours[i], hf(lp.MinPLogitsWarper(float(ps[i])), [0], logits[i]))


@pytest.mark.hf
def test_min_new_tokens_equals_transformers(lp):
    logits, prompts, new = cases(10)
    rng = np.random.default_rng(11)
    eos = rng.integers(0, VOCAB, (CASES, 3)).astype(np.int32)
    eos[:, 2] = np.where(rng.random(CASES) < 0.5, -1, eos[:, 2])  # padded lists
    min_new = rng.integers(0, 12, CASES).astype(np.int32)
    n_new = np.asarray([len(n) for n in new], np.int32)
    run = jax.jit(jax.vmap(lambda x, n, e, m: suppress(x, n, np.full(1, -1, np.int32), e, m)))
    ours = run(logits, n_new, eos, min_new)
    for i in range(CASES):
        ids = [int(e) for e in eos[i] if e >= 0]
        processor = lp.MinNewTokensLengthLogitsProcessor(len(prompts[i]), int(min_new[i]), ids)
        assert_same(ours[i], hf(processor, prompts[i] + new[i], logits[i]))


@pytest.mark.hf
def test_bad_ids_equal_transformers_no_bad_words(lp):
    logits, prompts, new = cases(12)
    rng = np.random.default_rng(13)
    bad = [rng.choice(VOCAB, rng.integers(1, 9), replace=False).tolist() for _ in range(CASES)]
    padded = np.full((CASES, 8), -1, np.int32)
    for i, ids in enumerate(bad):
        padded[i, : len(ids)] = ids
    no_eos = np.full(1, -1, np.int32)
    run = jax.jit(jax.vmap(lambda x, b: suppress(x, 0, b, no_eos, 0)))
    ours = run(logits, padded)
    for i in range(CASES):
        processor = lp.NoBadWordsLogitsProcessor([[b] for b in bad[i]])
        assert_same(ours[i], hf(processor, prompts[i] + new[i], logits[i]))


@pytest.mark.hf
def test_the_whole_chain_equals_transformers_in_its_order(lp):
    """Repetition penalty, bad ids, min_new, temperature, top-k, top-p, min-p: the list
    `_get_logits_processor` builds, against eqrope's processors and truncation."""
    logits, prompts, new = cases(14)
    rng = np.random.default_rng(15)
    settings = dict(
        repetition_penalty=rng.uniform(0.8, 2.0, CASES),
        temperature=rng.uniform(0.3, 2.0, CASES),
        top_k=rng.integers(1, VOCAB + 1, CASES),
        top_p=rng.uniform(0.3, 1.0, CASES),
        min_p=rng.uniform(0.0, 0.4, CASES),
        min_new=rng.integers(0, 8, CASES),
    )
    eos = rng.integers(0, VOCAB, (CASES, 2)).astype(np.int32)
    bad = rng.integers(0, VOCAB, (CASES, 2)).astype(np.int32)
    bad = np.where(bad == eos, (bad + 1) % VOCAB, bad)
    bad[:, 1] = np.where(np.isin(bad[:, 1], eos) | (bad[:, 1] == bad[:, 0]), -1, bad[:, 1])
    n_new = np.asarray([len(n) for n in new], np.int32)

    def ours(x, h, n, eos, bad, rep, temp, k, p, mp, mn):
        sampling = Sampling(
            temperature=temp, top_k=k, top_p=p, eos=eos, min_p=mp, repetition_penalty=rep,
            min_new=mn, bad=bad,
        )  # fmt: skip
        return truncate(process_logits(x, h, n, sampling) / temp, k, p, mp)[0]

    f32 = functools.partial(np.asarray, dtype=np.float32)
    got = jax.jit(jax.vmap(ours))(
        logits, stacked(map(history, prompts, new)), n_new, eos, bad,
        f32(settings["repetition_penalty"]), f32(settings["temperature"]),
        settings["top_k"].astype(np.int32), f32(settings["top_p"]), f32(settings["min_p"]),
        settings["min_new"].astype(np.int32),
    )  # fmt: skip
    for i in range(CASES):
        s = {k: v[i].item() for k, v in settings.items()}
        eos_ids = eos[i].tolist()
        chain = lp.LogitsProcessorList(
            [
                lp.RepetitionPenaltyLogitsProcessor(float(f32(s["repetition_penalty"]))),
                lp.NoBadWordsLogitsProcessor([[b] for b in bad[i].tolist() if b >= 0], eos_ids),
                lp.MinNewTokensLengthLogitsProcessor(len(prompts[i]), s["min_new"], eos_ids),
                lp.TemperatureLogitsWarper(float(f32(s["temperature"]))),
                lp.TopKLogitsWarper(s["top_k"]),
                lp.TopPLogitsWarper(float(f32(s["top_p"]))),
                lp.MinPLogitsWarper(float(f32(s["min_p"]))),
            ]
        )
        assert_same(got[i], hf(chain, prompts[i] + new[i], logits[i]))


def test_neutral_settings_change_nothing_bit_for_bit():
    logits, prompts, new = cases(16)
    h = stacked(map(history, prompts, new))
    neutral = Sampling(temperature=0.0, top_k=VOCAB, top_p=1.0, eos=np.full(1, -1, np.int32))
    out = jax.jit(jax.vmap(lambda x, h, n: process_logits(x, h, n, neutral)))(
        logits, h, np.zeros(CASES, np.int32)
    )
    np.testing.assert_array_equal(np.asarray(out), logits)
    scaled = jax.jit(jax.vmap(lambda x: truncate(x, VOCAB, 1.0, 0.0)[0]))(logits)
    np.testing.assert_array_equal(np.asarray(scaled), logits)
    assert jnp.asarray(out).dtype == jnp.float32


def test_without_top_k_and_top_p_the_unsorted_cut_keeps_the_same_bits():
    """`truncate` skips the sort when neither filter is on; forcing the sorted path gives
    the same bits, with infinities and NaNs among the logits too (a NaN is dropped)."""
    logits, _, _ = cases(18)
    logits[:8, :3] = [np.inf, -np.inf, np.nan]
    logits[8] = np.nan
    min_p = np.random.default_rng(19).uniform(0.0, 0.5, CASES).astype(np.float32)
    run = jax.jit(jax.vmap(lambda x, mp, s: truncate(x, VOCAB, 1.0, mp, s)[0], in_axes=(0, 0, None)))
    sorted_, unsorted = run(logits, min_p, True), run(logits, min_p, False)
    np.testing.assert_array_equal(np.asarray(sorted_).view(np.int32), np.asarray(unsorted).view(np.int32))
    assert np.all(np.isneginf(np.asarray(unsorted)[:9, 2]))


def _conds_around_sort(jaxpr) -> float:
    """The fewest `cond`s around a `sort` of `jaxpr` (inf without a sort)."""
    depth = float("inf")
    for eqn in jaxpr.eqns:
        inner = int(eqn.primitive.name == "cond")
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            depth = min(depth, inner + _conds_around_sort(sub))
        if eqn.primitive.name == "sort":
            depth = 0
    return depth


def test_the_sort_has_a_branch_of_its_own_also_for_settings_per_row():
    """When sampling, the sort still runs behind a `cond` on the batch's settings (under
    the greedy-or-sample one), also when each row has its own settings: a predicate per
    row would turn that `cond` into a select that sorts at every step."""
    logits, prompts, new = cases(20)
    rows = 4
    h = stacked(map(history, prompts[:rows], new[:rows]))
    one = Sampling(temperature=np.float32(1.0), top_k=np.int32(VOCAB), top_p=np.float32(1.0), eos=np.full(1, -1, np.int32))
    each = stack_rows([one._replace(top_k=np.int32(k)) for k in (VOCAB, 3, VOCAB, 7)])
    keys = jax.random.split(jax.random.key(0), rows)
    args = jax.tree.map(jnp.asarray, (logits[:rows], h, np.zeros(rows, np.int32), keys, np.arange(rows, dtype=np.int32)))
    shared = jax.vmap(choose_token, in_axes=(0, 0, 0, 0, 0, None))
    for fn, sampling in ((shared, one), (choose_rows, each)):
        assert _conds_around_sort(jax.make_jaxpr(fn)(*args, sampling).jaxpr) == 2
    # That each row still chooses what it chooses alone: tests/test_per_row_settings.py.


def test_the_token_logprob_is_log_softmax_entry_bit_for_bit():
    """`logprob_of` reads one entry without the vector: the same bits as `jax.nn.log_softmax`'s
    entry, with `-inf` logits among the others, and with the top given or found."""
    logits, _, _ = cases(21)
    logits[:40, :5] = -np.inf
    tokens = np.random.default_rng(22).integers(5, VOCAB, CASES).astype(np.int32)
    want = jax.jit(jax.vmap(lambda x, t: jax.nn.log_softmax(x)[t]))(logits, tokens)
    found = jax.jit(jax.vmap(logprob_of))(logits, tokens)
    given = jax.jit(jax.vmap(logprob_of))(logits, tokens, logits.max(axis=1))
    for ours in (found, given):
        np.testing.assert_array_equal(np.asarray(ours).view(np.int32), np.asarray(want).view(np.int32))


def test_truncate_returns_the_top_logit_every_filter_keeps():
    logits, _, _ = cases(23)
    ks = np.random.default_rng(24).integers(1, VOCAB + 5, CASES).astype(np.int32)
    ps = np.random.default_rng(25).uniform(0.05, 1.0, CASES).astype(np.float32)
    mps = np.random.default_rng(26).uniform(0.0, 1.0, CASES).astype(np.float32)
    kept, top = jax.jit(jax.vmap(truncate))(logits, ks, ps, mps)
    np.testing.assert_array_equal(np.asarray(top), logits.max(axis=1))
    np.testing.assert_array_equal(np.asarray(kept).max(axis=1), logits.max(axis=1))
