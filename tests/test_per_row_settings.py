"""Settings per row: `generate(model, prompts, [3, 6, 9], temperature=[0.0, 1.0, 0.7])`.

Checked against the same prompts generated one at a time with scalar settings and the
documented row keys: each row of a per-row call equals its prompt alone with its own
settings (greedy, sampled, truncated, penalized, `min_new`, `max_new`), with
`num_samples` too; the uncached reference path agrees; new values compile nothing; and
every misuse names the row or the fix.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqrope
from _compiles import counting
from _models import random_model
from _unhooked import messages_without_the_hook
from eqrope.testing import Uncached


VOCAB = 23
PROMPT = np.array([[3, 1, 4, 1, 5, 9, 2], [6, 5, 3, 5, 0, 0, 0], [1, 2, 3, 4, 5, 6, 0]], np.int32)
LENGTHS = np.array([7, 4, 6], np.int32)
KEY = jax.random.key(7)

# Each a set of per-row settings: {name: (row 0, row 1, row 2)}.
SETS = {
    "greedy and sampled": dict(
        max_new=(3, 6, 9), temperature=(0.0, 1.0, 0.7), top_k=(None, 5, 12),
        top_p=(None, 0.9, 1.0), min_p=(0.0, None, 0.05),
    ),
    "penalties and min_new": dict(
        temperature=(0.0, 0.9, 0.0), repetition_penalty=(1.0, 1.5, 0.8),
        presence_penalty=(0.0, 0.5, -0.3), frequency_penalty=(0.0, 0.2, 0.4), min_new=(0, 4, 2),
    ),
    "greedy, truncation per row": dict(temperature=(0.0, 0.0, 0.0), top_k=(None, 3, 7), max_new=(9, 1, 4)),
}  # fmt: skip
SHARED = dict(eos_id=[2], return_logprobs=True)


@pytest.fixture(scope="module")
def model():
    return random_model(4, VOCAB, 16, 2, 1, 64, d_ff=32)


def per_row_call(model, settings, **kwargs):
    settings = {"max_new": (9, 9, 9), **settings}
    return eqrope.generate(model, PROMPT, prompt_lengths=LENGTHS, key=KEY, **SHARED, **settings, **kwargs)


def alone(model, i, settings, key, **kwargs):
    """Row `i`'s prompt generated alone, with row `i`'s scalar settings."""
    scalars = {"max_new": 9, **{name: values[i] for name, values in settings.items()}}
    return eqrope.generate(model, PROMPT[i, : LENGTHS[i]], key=key, **SHARED, **scalars, **kwargs)


def assert_same_text(batch, i, one, *, sample=None):
    """Row `i` (sample `sample`) of `batch` holds `one`'s text and log-probabilities."""
    at = (i,) if sample is None else (i, sample)
    length = int(one.lengths)
    assert int(batch.lengths[at]) == length
    np.testing.assert_array_equal(np.asarray(batch.tokens)[at][:length], np.asarray(one.tokens)[:length])
    np.testing.assert_allclose(np.asarray(batch.logprobs)[at][:length], np.asarray(one.logprobs)[:length], atol=1e-5)


@pytest.mark.parametrize("name", SETS)
def test_each_row_equals_its_prompt_alone_with_its_settings(model, name):
    settings = SETS[name]
    batch = per_row_call(model, settings)
    for i, row_key in enumerate(jax.random.split(KEY, 3)):  # row i's documented key
        assert_same_text(batch, i, alone(model, i, settings, row_key))


def test_a_shared_stop_sequence_ends_each_row_as_alone(model):
    settings = dict(temperature=(0.0, 1.0, 0.0), top_k=(None, 5, 3))
    batch = per_row_call(model, settings, stop=[[1, 8]])
    assert (np.asarray(batch.lengths) < LENGTHS + 9).any()  # the stop ends a row early
    for i, row_key in enumerate(jax.random.split(KEY, 3)):
        assert_same_text(batch, i, alone(model, i, settings, row_key, stop=[[1, 8]]))


def test_each_sample_equals_its_prompt_alone(model):
    settings, n = SETS["greedy and sampled"], 2
    batch = per_row_call(model, settings, num_samples=n)
    assert batch.tokens.shape[:2] == (3, n)
    for i, row_key in enumerate(jax.random.split(KEY, 3)):
        for j, sample_key in enumerate(jax.random.split(row_key, n)):
            assert_same_text(batch, i, alone(model, i, settings, sample_key), sample=j)


@pytest.mark.parametrize("samples", [None, 2])
def test_the_uncached_reference_path_agrees(model, samples):
    settings = {**SETS["greedy and sampled"], **SETS["penalties and min_new"]}
    cached = per_row_call(model, settings, num_samples=samples)
    reference = per_row_call(Uncached(model), settings, num_samples=samples)
    np.testing.assert_array_equal(np.asarray(cached.tokens), np.asarray(reference.tokens))
    np.testing.assert_array_equal(np.asarray(cached.lengths), np.asarray(reference.lengths))
    np.testing.assert_allclose(np.asarray(cached.logprobs), np.asarray(reference.logprobs), atol=2e-5)


def test_max_new_per_row_gives_each_row_its_length(model):
    max_new = np.array([0, 2, 5])
    out = eqrope.generate(model, PROMPT, max_new, prompt_lengths=LENGTHS, return_logprobs=True)
    np.testing.assert_array_equal(np.asarray(out.lengths), LENGTHS + max_new)
    for i in range(3):
        one = eqrope.generate(model, PROMPT[i, : LENGTHS[i]], int(max_new[i]))
        np.testing.assert_array_equal(np.asarray(out.tokens)[i, : len(one)], np.asarray(one))
    # With a draft: the same tokens, each row ending at its own max_new.
    drafted = eqrope.generate(model, PROMPT, list(max_new), prompt_lengths=LENGTHS, draft="prompt_lookup")
    np.testing.assert_array_equal(np.asarray(drafted), np.asarray(out.tokens))


def test_the_truncation_warning_names_the_row_cut(model):
    with pytest.warns(eqrope.TruncationWarning, match=r"max_new\[2\]=14, but max_len=16 holds 10 new tokens after the prompt of 6 in row 2, so 4 will not be generated\. Pass max_new\[2\] <= 10"):
        out = eqrope.generate(model, PROMPT, [2, 3, 14], prompt_lengths=LENGTHS, max_len=16, return_logprobs=True)
    np.testing.assert_array_equal(np.asarray(out.lengths), [9, 7, 16])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every row fits: no warning
        eqrope.generate(model, PROMPT, [9, 12, 10], prompt_lengths=LENGTHS, max_len=16)


def test_new_values_compile_nothing(model):
    def run(max_new, temperature, top_k, penalty, min_new, seed):
        eqrope.generate(
            model, PROMPT, max_new, prompt_lengths=LENGTHS, temperature=temperature, top_k=top_k,
            repetition_penalty=penalty, min_new=min_new, eos_id=[2], key=jax.random.key(seed),
        )  # fmt: skip

    run([3, 4, 5], [0.0, 1.0, 0.5], [None, 4, 9], [1.0, 1.2, 0.9], [0, 1, 2], 0)
    eqrope.generate(model, PROMPT, 5, prompt_lengths=LENGTHS, eos_id=[2])  # the scalar program
    temperatures = jnp.array([0.3, 0.0, 2.0])
    with counting() as c:
        run(np.array([1, 9, 2]), temperatures, (2, None, 1), [1.5, 1.0, 1.0], [3, 0, 0], 1)
        run([4, 4, 4], [0.0, 0.0, 0.0], [5, 5, 5], [1.0, 1.0, 1.0], [0, 0, 0], 2)
        eqrope.generate(model, PROMPT, 6, prompt_lengths=LENGTHS, eos_id=[2], temperature=0.4, key=KEY)
    assert c.traces["generate_program"] == 0, dict(c.traces)
    assert sum(c.compiles.values()) == 0, dict(c.compiles)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(temperature=[0.5, -1.0, 0.2]), ValueError, r"temperature\[1\] must be >= 0"),
        (dict(top_k=[5, 0, 3]), ValueError, r"top_k\[1\] must be a positive int or None, got 0"),
        (dict(top_p=(0.5, 1.0, 1.5)), ValueError, r"top_p\[2\] must be in \(0, 1\]"),
        (dict(max_new=[1, 2.5, 3]), TypeError, r"max_new\[1\] must be an int"),
        (dict(repetition_penalty=np.array([1.0, 0.0, 1.0])), ValueError, r"repetition_penalty\[1\] must be a finite number > 0"),
        (dict(temperature=[0.1, 0.2]), ValueError, r"temperature has 2 values, one per row, but the prompt has 3 rows: pass 3 values"),
        (dict(min_p=np.zeros((3, 2))), ValueError, r"min_p must be one value for every row, or a \(batch,\) sequence"),
        (dict(temperature=[0.0, 0.5, 0.0]), ValueError, r"pass key=jax\.random\.key"),
        (dict(temperature=[0.0, 0.5, 0.0], key=KEY, draft="prompt_lookup"), ValueError, r"per-row settings run without a draft"),
    ],
)  # fmt: skip
def test_misuse_names_the_row_and_the_fix(model, kwargs, error, match):
    kwargs = {"max_new": 3, **kwargs}
    with pytest.raises(error, match=match):
        eqrope.generate(model, PROMPT, prompt_lengths=LENGTHS, **kwargs)


def test_a_one_d_prompt_says_to_pass_a_batch(model):
    with pytest.raises(ValueError, match=r"temperature has 2 values, one per row, but the prompt is 1-D .* a \(batch, seq\) prompt"):
        eqrope.generate(model, PROMPT[0], 3, temperature=[0.0, 1.0], key=KEY)


def test_a_list_of_configs_says_to_pass_settings_per_row():
    # Run without the jaxtyping hook, which would refuse the list first under pytest.
    setup = """
    import numpy as np
    import eqrope
    from _models import random_model
    model = random_model(4, 23, 16, 2, 1, 64, d_ff=32)
    configs = [eqrope.GenerationConfig(max_new=3)] * 2
    cases = {"configs": lambda: eqrope.generate(model, np.ones((2, 3), np.int32), config=configs)}
    """
    message = messages_without_the_hook(setup)["configs"]
    assert message.startswith("TypeError: config must be one eqrope.GenerationConfig"), message
    assert "For settings that differ per row, pass (batch,) arrays" in message
    assert "temperature=[0.0, 0.8]" in message


def test_vmap_over_a_setting_points_to_per_row_arrays(model):
    def one(temperature):
        return eqrope.generate(model, PROMPT[0], 3, temperature=temperature, key=KEY)

    with pytest.raises(TypeError, match=r"traced temperature.*pass a \(batch,\) array of them with a \(batch, seq\) prompt"):
        jax.vmap(one)(jnp.array([0.5, 1.0]))
