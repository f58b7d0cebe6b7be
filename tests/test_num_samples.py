"""`num_samples=n`: n continuations per prompt from one prefill.

Checked: the shapes of every result; each sample equals generating it alone with its
documented key; the uncached path agrees; and the prompt is prefilled once per prompt,
not once per sample (counted as the program runs, and read off the program's jaxpr).
"""

import jax
import numpy as np
import pytest

import eqrope
from _compiles import counting
from _models import random_model
from eqrope.generation import _decode
from eqrope.generation._request import parse_request
from eqrope.generation._generation_config import GenerationConfig
from eqrope.testing import Uncached
from test_generate_work import EXECUTED, CountingDecoder, all_eqns


VOCAB = 23
PROMPT = np.array([[3, 1, 4, 1, 5, 9, 2], [6, 5, 3, 5, 0, 0, 0]], np.int32)
LENGTHS = np.array([7, 4], np.int32)


@pytest.fixture(scope="module")
def model():
    return random_model(4, VOCAB, 16, 2, 1, 64, d_ff=32)


def test_shapes(model):
    key = jax.random.key(0)
    one = eqrope.generate(model, PROMPT[0], 5, num_samples=3, temperature=1.0, key=key, return_logprobs=True)
    assert one.tokens.shape == one.logprobs.shape == one.model_logprobs.shape == (3, 12)
    assert one.lengths.shape == (3,)
    batch = eqrope.generate(
        model, PROMPT, 5, prompt_lengths=LENGTHS, num_samples=3, temperature=1.0, key=key,
        return_logprobs=True,
    )  # fmt: skip
    assert batch.tokens.shape == batch.logprobs.shape == batch.model_logprobs.shape == (2, 3, 12)
    assert batch.lengths.shape == (2, 3)
    assert eqrope.generate(model, PROMPT[0], 5, num_samples=1).shape == (1, 12)
    samples = np.asarray(batch.tokens)
    assert len({tuple(s) for s in samples[0]}) > 1  # the samples differ


def test_each_sample_is_reproduced_alone_with_its_key(model):
    key, n = jax.random.key(5), 3
    kwargs = dict(temperature=1.2, top_k=12, repetition_penalty=1.2, eos_id=[2])
    batch = eqrope.generate(model, PROMPT, 9, prompt_lengths=LENGTHS, num_samples=n, key=key, return_logprobs=True, **kwargs)
    for i, row_key in enumerate(jax.random.split(key, 2)):
        for j, sample_key in enumerate(jax.random.split(row_key, n)):
            alone = eqrope.generate(model, PROMPT[i, : LENGTHS[i]], 9, key=sample_key, return_logprobs=True, **kwargs)
            length = int(alone.lengths)
            assert int(batch.lengths[i, j]) == length
            np.testing.assert_array_equal(np.asarray(batch.tokens)[i, j, :length], np.asarray(alone.tokens)[:length])
            np.testing.assert_allclose(np.asarray(batch.logprobs)[i, j, :length], np.asarray(alone.logprobs)[:length], atol=1e-5)
    # A 1-D prompt: sample j has jax.random.split(key, n)[j].
    one = eqrope.generate(model, PROMPT[0], 6, num_samples=n, key=key, **kwargs)
    for j, sample_key in enumerate(jax.random.split(key, n)):
        np.testing.assert_array_equal(one[j], eqrope.generate(model, PROMPT[0], 6, key=sample_key, **kwargs))


def test_uncached_path_agrees(model):
    kwargs = dict(prompt_lengths=LENGTHS, num_samples=2, temperature=1.0, key=jax.random.key(2), return_logprobs=True)
    cached = eqrope.generate(model, PROMPT, 6, **kwargs)
    plain = eqrope.generate(Uncached(model), PROMPT, 6, **kwargs)
    np.testing.assert_array_equal(np.asarray(cached.tokens), np.asarray(plain.tokens))
    np.testing.assert_allclose(cached.logprobs, plain.logprobs, atol=2e-5)


def test_one_prefill_per_prompt_not_per_sample(model):
    wrapped = CountingDecoder(model)
    for samples in (None, 4):
        EXECUTED.clear()
        out = eqrope.generate(wrapped, PROMPT, 3, prompt_lengths=LENGTHS, num_samples=samples, prefill_chunk=16)
        jax.effects_barrier()
        kinds = [kind for kind, _ in EXECUTED]
        assert kinds.count("prefill") == 2  # two prompts, one chunk each
        # Every sample decodes: a step after each new token but the last (the loop skips
        # the step once every row has ended).
        assert kinds.count("step") == (3 - 1) * 2 * (samples or 1)
    assert out.shape == (2, 4, 10)


def test_the_prefill_runs_on_the_prompts_rows(model):
    """In the program's jaxpr, the prefill runs the blocks on the 2 prompts' rows of a
    chunk and its head on one row per prompt (the last token's); the decode loop's head
    on 2 * 4 rows."""
    chunk = 6  # no other dimension is 6
    closed = jax.make_jaxpr(
        lambda *a: _decode.decode_program(model, *a, batched=True, chunk=chunk, samples=4)
    )(*_program_args(model))
    heads = [
        e.outvars[0].aval.shape
        for e in all_eqns(closed.jaxpr)
        if e.primitive.name == "dot_general" and e.outvars[0].aval.shape[-1] == VOCAB
    ]
    assert sorted({int(np.prod(s)) for s in heads}) == [2 * VOCAB, 2 * 4 * VOCAB]
    blocks = [
        e.outvars[0].aval.shape
        for e in all_eqns(closed.jaxpr)
        if e.primitive.name == "dot_general" and chunk in e.outvars[0].aval.shape
    ]
    assert blocks  # the blocks' products do run on the chunk's rows


def _program_args(model):
    request = parse_request(
        model, PROMPT, GenerationConfig(max_new=3, num_samples=4), max_len=None, key=None,
        prompt_lengths=LENGTHS,
    )  # fmt: skip
    buffer = np.zeros((2, request.max_len), np.int32)
    buffer[:, : PROMPT.shape[1]] = PROMPT
    return buffer, request.lengths, np.int32(3), request.sampling, request.key


def test_num_samples_compiles_once_per_value(model):
    eqrope.generate(model, PROMPT, 4, prompt_lengths=LENGTHS, num_samples=3, temperature=1.0, key=jax.random.key(0))
    with counting() as c:
        for seed in range(3):
            eqrope.generate(model, PROMPT, 4, prompt_lengths=LENGTHS, num_samples=3, temperature=0.5, key=jax.random.key(seed))
    assert c.traces["generate_program"] == 0
