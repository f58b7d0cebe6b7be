"""Penalties, `min_p`, `bad_ids`, `stop`, `min_new` and the two log-probabilities.

Three kinds of proof:

- against transformers' `generate` on the same weights (`eqrope.to_hf_llama`; tests
  marked `hf`): identical greedy tokens under each processor;
- against the uncached reference path, which keeps its own history and stop matching:
  identical sampled tokens under every processor, with the same key;
- by hand: where a row stops, what the log-probabilities are, that nothing recompiles.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqrope
from _compiles import counting
from _models import random_model
from eqrope.testing import Uncached


VOCAB = 61
PROMPT = np.random.default_rng(2).integers(0, VOCAB, 8).astype(np.int32)


@pytest.fixture(scope="module")
def model():
    return random_model(5, VOCAB, 32, 4, 2, 96, head_bias=False)


@pytest.fixture(scope="module")
def free(model):
    """Greedy tokens without any processor: the new tokens of `PROMPT`."""
    return np.asarray(eqrope.generate(model, PROMPT, 30))[8:].tolist()


def new_tokens(result) -> list[int]:
    tokens, length = np.asarray(result.tokens), int(result.lengths)
    return tokens[8:length].tolist()


# -- against transformers' generate ------------------------------------------------------------


@pytest.fixture(scope="module")
def theirs(model, tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    path = tmp_path_factory.mktemp("llama")
    eqrope.to_hf_llama(model, path)
    return transformers.LlamaForCausalLM.from_pretrained(path).eval()


def hf_greedy(theirs, max_new, **kwargs) -> list[int]:
    import torch

    ids = torch.tensor(PROMPT, dtype=torch.long)[None]
    with torch.no_grad():
        out = theirs.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
            pad_token_id=0, **kwargs,
        )  # fmt: skip
    return out[0, 8:].tolist()


@pytest.mark.hf
def test_transformers_agrees_without_processors(model, theirs, free):
    assert hf_greedy(theirs, 30) == free


@pytest.mark.hf
@pytest.mark.parametrize("penalty", [1.3, 0.7, 2.5])
def test_repetition_penalty_tokens_equal_transformers(model, theirs, free, penalty):
    ours = new_tokens(eqrope.generate(model, PROMPT, 30, repetition_penalty=penalty, return_logprobs=True))
    assert ours == hf_greedy(theirs, 30, repetition_penalty=penalty)
    assert ours != free


def eos_pair(free) -> list[int]:
    """Two distinct ids of the greedy text, the later-appearing one first."""
    return [free[6], free[2]]


def test_eos_pair_is_two_ids(free):
    assert len(set(eos_pair(free))) == 2


@pytest.mark.hf
def test_eos_list_tokens_equal_transformers(model, theirs, free):
    eos = eos_pair(free)
    ours = new_tokens(eqrope.generate(model, PROMPT, 30, eos_id=eos, return_logprobs=True))
    stop = min(free.index(e) for e in eos) + 1
    assert ours == free[:stop] == hf_greedy(theirs, 30, eos_token_id=eos)


@pytest.mark.hf
def test_min_new_with_an_eos_list_equals_transformers(model, theirs, free):
    eos = eos_pair(free)
    first = min(free.index(e) for e in eos)
    for min_new in (first + 1, first + 3, 12):
        ours = new_tokens(
            eqrope.generate(model, PROMPT, 30, eos_id=eos, min_new=min_new, return_logprobs=True)
        )
        assert ours == hf_greedy(theirs, 30, eos_token_id=eos, min_new_tokens=min_new)
        assert len(ours) > min_new and not set(ours[:min_new]) & set(eos)


@pytest.mark.hf
def test_bad_ids_tokens_equal_transformers(model, theirs, free):
    counts = np.bincount(free, minlength=VOCAB)
    bad = np.argsort(-counts)[:3].tolist()
    ours = new_tokens(eqrope.generate(model, PROMPT, 30, bad_ids=bad, return_logprobs=True))
    assert ours == hf_greedy(theirs, 30, bad_words_ids=[[b] for b in bad])
    assert not set(ours) & set(bad)


@pytest.mark.hf
def test_every_greedy_processor_at_once_from_a_generation_config_file(model, theirs, free, tmp_path):
    """transformers writes a generation_config.json; eqrope reads it and agrees."""
    transformers = pytest.importorskip("transformers")
    eos = eos_pair(free)
    bad = [t for t in dict.fromkeys(free) if t not in eos][:2]
    hf_config = transformers.GenerationConfig(
        max_new_tokens=25, do_sample=False, repetition_penalty=1.2, eos_token_id=eos,
        pad_token_id=0, min_new_tokens=6, bad_words_ids=[[b] for b in bad],
    )  # fmt: skip
    hf_config.save_pretrained(tmp_path)
    config = eqrope.GenerationConfig.from_pretrained(tmp_path)
    assert (config.max_new, config.repetition_penalty, config.min_new) == (25, 1.2, 6)
    assert config.eos_id == tuple(eos) and config.bad_ids == tuple(bad)
    ours = new_tokens(eqrope.generate(model, PROMPT, config=config, return_logprobs=True))
    import torch

    ids = torch.tensor(PROMPT, dtype=torch.long)[None]
    with torch.no_grad():
        want = theirs.generate(ids, attention_mask=torch.ones_like(ids), generation_config=hf_config)
    assert ours == want[0, 8:].tolist()


# -- cached against uncached, sampling -----------------------------------------------------------

SETTINGS = {
    "repetition": dict(repetition_penalty=0.3),  # below 1: favours the prompt's tokens
    "presence": dict(presence_penalty=1.5),
    "frequency": dict(frequency_penalty=3.0),
    "negative": dict(presence_penalty=-1.0, frequency_penalty=-0.5),
    "min_p": dict(min_p=0.2),
    "top_k+top_p+min_p": dict(top_k=10, top_p=0.8, min_p=0.1),
    "bad_ids": dict(bad_ids=[1, 2, 3, 5, 8, 13, 21, 34, 55]),
    # Settings read off the text sampled without processors (`base`, two rows of new
    # tokens), so that they act on it.
    "stop": lambda base: dict(stop=[base[0][3:5], base[1][6:7], [60, 60, 60]]),
    "min_new": lambda base: dict(eos_id=[base[0][1], base[1][2]], min_new=4),
    "all": lambda base: dict(
        repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3, min_p=0.05,
        top_k=40, top_p=0.95, bad_ids=[9], stop=[base[0][2:4]], eos_id=[base[1][3]], min_new=2,
    ),
}  # fmt: skip
PROMPTS = np.stack([PROMPT, np.roll(PROMPT, 3)])
SAMPLING = dict(temperature=1.3, key=jax.random.key(4), prompt_lengths=[8, 5])


@pytest.fixture(scope="module")
def base(model):
    out = eqrope.generate(model, PROMPTS, 14, **SAMPLING)
    return [np.asarray(out)[0, 8:].tolist(), np.asarray(out)[1, 5:19].tolist()]


def settings(name, base) -> dict:
    kwargs = SETTINGS[name]
    return kwargs(base) if callable(kwargs) else kwargs


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_cached_equals_uncached_under_every_processor(model, base, name):
    kwargs = dict(settings(name, base), **SAMPLING, return_logprobs=True)
    cached = eqrope.generate(model, PROMPTS, 14, **kwargs)
    plain = eqrope.generate(Uncached(model), PROMPTS, 14, **kwargs)
    np.testing.assert_array_equal(np.asarray(cached.tokens), np.asarray(plain.tokens))
    np.testing.assert_array_equal(np.asarray(cached.lengths), np.asarray(plain.lengths))
    for field in ("logprobs", "model_logprobs"):
        np.testing.assert_allclose(getattr(cached, field), getattr(plain, field), atol=2e-5)
    free = eqrope.generate(model, PROMPTS, 14, **SAMPLING)
    assert not np.array_equal(np.asarray(cached.tokens), np.asarray(free)), "the setting did nothing"


# -- stop sequences and min_new ---------------------------------------------------------------------


def first_match(free, pair, after=0) -> int:
    """The number of new tokens up to the first match of `pair` in the prompt and the
    greedy text that ends on a new token, after the first `after` of them."""
    text = PROMPT.tolist() + free
    return next(j - 7 for j in range(8 + after, len(text)) if text[j - 1 : j + 1] == pair)


def test_a_row_ends_after_its_first_complete_stop_sequence(model, free):
    pair = free[5:7]  # two tokens the greedy text holds
    stop = [[VOCAB - 1, VOCAB - 1, VOCAB - 1], pair]  # the first never completes
    out = eqrope.generate(model, PROMPT, 30, stop=stop, return_logprobs=True)
    new = new_tokens(out)
    end = first_match(free, pair)
    assert new == free[:end]  # the stop tokens are kept
    assert (np.asarray(out.tokens)[8 + end :] == 0).all()  # then pad_id
    # A stop sequence may begin in the prompt: the prompt's last token, then the first new.
    across = eqrope.generate(model, PROMPT, 30, stop=[[int(PROMPT[-1]), free[0]]], return_logprobs=True)
    assert new_tokens(across) == free[:1]
    # A one-token stop sequence acts as an EOS id.
    np.testing.assert_array_equal(
        eqrope.generate(model, PROMPT, 30, stop=[[free[6]]]),
        eqrope.generate(model, PROMPT, 30, eos_id=free[6], pad_id=0),
    )


def test_min_new_holds_back_stop_sequences(model, free):
    pair = free[5:7]
    end = first_match(free, pair)
    ended = new_tokens(eqrope.generate(model, PROMPT, 30, stop=[pair], min_new=end - 1, return_logprobs=True))
    assert ended == free[:end]  # the match ends on new token min_new + 1: it counts
    later = new_tokens(eqrope.generate(model, PROMPT, 30, stop=[pair], min_new=end, return_logprobs=True))
    assert later == free[: first_match(free, pair, after=end)]  # the next match ends it
    assert len(later) > end


# -- the two log-probabilities --------------------------------------------------------------------


def test_logprobs_are_the_processed_distribution_and_model_logprobs_the_models(model):
    temperature, key = 0.8, jax.random.key(7)
    kwargs = dict(repetition_penalty=1.5, min_p=0.1, top_k=20, bad_ids=[3], temperature=temperature, key=key)
    out = eqrope.generate(model, PROMPT, 10, return_logprobs=True, **kwargs)
    tokens = np.asarray(out.tokens)
    logits = np.asarray(eqx_full(model, tokens[:-1]), np.float64)[7:]
    for step, t in enumerate(range(8, 18)):
        raw = logits[step]
        own = raw / temperature - np.log(np.exp(raw / temperature - (raw / temperature).max()).sum()) - (raw / temperature).max()
        np.testing.assert_allclose(out.model_logprobs[t], own[tokens[t]], atol=2e-5)
        # By hand: penalty over the text so far, the ban, temperature, top-k 20, min-p.
        x = raw.copy()
        seen = np.zeros(VOCAB, bool)
        seen[tokens[:t]] = True
        x[seen] = np.where(x[seen] < 0, x[seen] * 1.5, x[seen] / 1.5)
        x[3] = -np.inf
        x = x / temperature
        x[x < np.sort(x)[-20]] = -np.inf
        p = np.exp(x - x.max())
        x[p < 0.1 * p.max()] = -np.inf
        logp = x - x.max() - np.log(np.exp(x - x.max()).sum())
        np.testing.assert_allclose(out.logprobs[t], logp[tokens[t]], atol=2e-5)
        assert np.isfinite(logp[tokens[t]])
    assert (np.asarray(out.logprobs)[:8] == 0).all() and (np.asarray(out.model_logprobs)[:8] == 0).all()


def eqx_full(model, ids):
    return jax.jit(lambda m, x: m(x))(model, jnp.asarray(ids, jnp.int32))


def test_greedy_logprobs_without_processors_are_the_models(model):
    out = eqrope.generate(model, PROMPT, 10, return_logprobs=True)
    np.testing.assert_array_equal(np.asarray(out.logprobs), np.asarray(out.model_logprobs))


# -- one program for every value ----------------------------------------------------------------------


def test_no_retrace_over_a_sweep_of_every_setting(model):
    key = jax.random.key(0)
    sweep = [dict(temperature=t, key=key) for t in (0.0, 0.5, 2.0)]
    sweep += [dict(top_k=k, temperature=1.0, key=key) for k in (None, 1, 5, 100)]
    sweep += [dict(top_p=p, temperature=1.0, key=key) for p in (None, 0.1, 0.9, 1.0)]
    sweep += [dict(min_p=p, temperature=1.0, key=key) for p in (None, 0.0, 0.3, 1.0)]
    sweep += [dict(repetition_penalty=p) for p in (1.0, 0.5, 1.3, 7.0)]
    sweep += [dict(presence_penalty=p) for p in (0.0, -2.0, 0.7)]
    sweep += [dict(frequency_penalty=p) for p in (0.0, 2.0, -0.3)]
    sweep += [dict(eos_id=e) for e in (3, 7, [9], (0,))]
    sweep += [dict(min_new=m, eos_id=[3]) for m in (0, 2, 1000)]
    sweep += [dict(bad_ids=b) for b in (None, [1], [2, 3, 4], list(range(8)))]
    sweep += [dict(stop=s) for s in (None, [[1]], [[1, 2], [3]], [[1, 2, 3, 4]] * 4)]
    sweep += [dict(pad_id=p) for p in (None, 5)]
    eqrope.generate(model, PROMPT, 6, max_len=32)
    # No stop list is a program of its own, without matching: the first stop compiles once.
    with counting() as c:
        eqrope.generate(model, PROMPT, 6, max_len=32, stop=[[1]])
    assert c.traces["generate_program"] == 1, dict(c.traces)
    with counting() as c:
        for kwargs in sweep:
            eqrope.generate(model, PROMPT, 6, max_len=32, **kwargs)
    assert c.traces["generate_program"] == 0, dict(c.traces)
    # An EOS list of another length is another program, once.
    with counting() as c:
        for eos in ([3, 4], [5, 6], (7, 8)):
            eqrope.generate(model, PROMPT, 6, max_len=32, eos_id=eos)
    assert c.traces["generate_program"] <= 1, dict(c.traces)


# -- what generate refuses ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(repetition_penalty=0.0), ValueError, r"repetition_penalty must be a finite number > 0"),
        (dict(repetition_penalty=-1.2), ValueError, r"repetition_penalty must be a finite number > 0"),
        (dict(presence_penalty=float("nan")), ValueError, r"presence_penalty must be a finite number"),
        (dict(frequency_penalty=float("inf")), ValueError, r"frequency_penalty must be a finite number"),
        (dict(min_p=1.5), ValueError, r"min_p must be in \[0, 1\]"),
        (dict(min_p=-0.1), ValueError, r"min_p must be in \[0, 1\]"),
        (dict(min_p="0.1"), TypeError, r"min_p"),
        (dict(bad_ids=[VOCAB]), ValueError, rf"bad_ids\[0\] must be a token id in \[0, vocab_size={VOCAB}\)"),
        (dict(bad_ids=[-1]), ValueError, r"bad_ids\[0\] must be a token id"),
        (dict(bad_ids=[]), ValueError, r"bad_ids is an empty sequence; pass None"),
        (dict(bad_ids=list(range(VOCAB))), ValueError, r"bad_ids bans all 61 token ids"),
        (dict(bad_ids=[3], eos_id=3), ValueError, r"bad_ids and eos_id share \[3\]"),
        (dict(stop=[]), ValueError, r"stop is an empty list; pass None"),
        (dict(stop=[[1], []]), ValueError, r"stop\[1\] is an empty sequence"),
        (dict(stop=[13, 13]), TypeError, r"Wrap one sequence in a list: stop=\[\[13, 13\]\]"),
        (dict(stop=[[1, VOCAB]]), ValueError, r"stop\[0\]\[1\] must be a token id"),
        (dict(stop=["\n\n"]), TypeError, r"stop\[0\] is the string.*generate_text"),
        (dict(min_new=-1), ValueError, r"min_new must be an int >= 0"),
        (dict(num_samples=0), ValueError, r"num_samples must be a positive int"),
        (dict(config={"top_k": 3}), TypeError, r"config"),
    ],
)
def test_bad_settings_are_refused_by_name(model, kwargs, error, match):
    with pytest.raises(error, match=match):
        eqrope.generate(model, PROMPT, 3, **kwargs)


def test_every_setting_under_x64(model, base):
    """x64 mode: the same tokens as x32, and the uncached path agrees, with every setting,
    several samples and streaming on."""
    kwargs = dict(settings("all", base), **SAMPLING, num_samples=2)
    want = np.asarray(eqrope.generate(model, PROMPTS, 10, **kwargs))
    with jax.enable_x64(True):
        calls = []
        got = eqrope.generate(model, PROMPTS, 10, on_token=lambda *c: calls.append(c), **kwargs)
        plain = eqrope.generate(Uncached(model), PROMPTS, 10, **kwargs)
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(np.asarray(plain), want)
    assert len(calls) > 0
