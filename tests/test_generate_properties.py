"""Property tests (hypothesis) of the KV cache and `eqrope.generate` over small random configs.

Compiles dominate the cost, so the configurations come from a short list (each with its own
d_model, heads, kv_heads, blocks, max_len, d_ff and prefill chunk), while weights, prompts,
lengths, split points and sampling settings are drawn freely: those are data, not shapes,
and reuse the compiled programs.
"""


import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import eqrope
from _models import random_model
from eqrope.testing import Uncached


# vocab, d_model, heads, kv_heads, blocks, max_len, d_ff, prefill_chunk
CONFIGS = [
    (17, 16, 2, 1, 1, 12, 24, 5),  # multi-query; chunks start at 0, 5, 7 (overlapping)
    (23, 32, 4, 2, 2, 16, 48, 64),  # grouped-query; one chunk of 16
    (19, 24, 3, 3, 1, 10, 40, 4),  # multi-head, 3 heads of 8; chunks at 0, 4, 6
]

EXAMPLES = {}  # test name -> examples run, reported at the end of the module

SETTINGS = settings(
    max_examples=25,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.fixture(scope="module", autouse=True)
def report_examples(request):
    yield
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if capture is not None and reporter is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line(f"\nhypothesis examples run: {EXAMPLES}")


def count(name):
    EXAMPLES[name] = EXAMPLES.get(name, 0) + 1


_MODELS = {}


def model_for(config_index, seed):
    if (config_index, seed) not in _MODELS:
        vocab, d, heads, kv, blocks, max_len, d_ff, _ = CONFIGS[config_index]
        _MODELS[config_index, seed] = random_model(
            seed, vocab, d, heads, blocks, max_len, n_kv_heads=kv, d_ff=d_ff
        )
    return _MODELS[config_index, seed]


@eqx.filter_jit
def full(model, ids):
    return model(ids)


@eqx.filter_jit
def step(model, token, cache, pos):
    return model.step(token, cache, pos)


@eqx.filter_jit
def prefill(model, ids, cache, pos):
    return model.prefill(ids, cache, pos)


@st.composite
def cases(draw, batch=1):
    """A config, a weight seed, prompts (rows of random length) and generate's settings."""
    index = draw(st.integers(0, len(CONFIGS) - 1))
    vocab, *_, max_len, _, chunk = CONFIGS[index]
    seed = draw(st.integers(0, 3))
    lengths = draw(st.lists(st.integers(1, max_len), min_size=batch, max_size=batch))
    width = max(lengths)
    prompt = draw(
        st.lists(st.integers(0, vocab - 1), min_size=batch * width, max_size=batch * width)
    )
    prompt = np.asarray(prompt, np.int32).reshape(batch, width)
    max_new = draw(st.integers(0, max_len))
    sampling = draw(
        st.one_of(
            st.just({}),
            st.fixed_dictionaries(
                {
                    "temperature": st.floats(0.1, 3.0),
                    "key": st.integers(0, 2**31 - 1).map(jax.random.PRNGKey),
                },
                optional={
                    "top_k": st.integers(1, vocab + 2),
                    "top_p": st.floats(0.05, 1.0),
                },
            ),
        )
    )
    return index, seed, prompt, np.asarray(lengths, np.int32), max_new, sampling, chunk


# max_new is drawn up to max_len: the cache cuts some texts on purpose, which warns.
@pytest.mark.filterwarnings("ignore::eqrope.TruncationWarning")
@SETTINGS
@given(case=cases())
def test_cached_equals_uncached(case):
    index, seed, prompt, lengths, max_new, sampling, chunk = case
    model = model_for(index, seed)
    prompt = jnp.asarray(prompt[0])
    cached = eqrope.generate(model, prompt, max_new, prefill_chunk=chunk, **sampling)
    uncached = eqrope.generate(Uncached(model), prompt, max_new, **sampling)
    assert cached.shape == (min(prompt.shape[0] + max_new, model.max_len),)
    np.testing.assert_array_equal(np.asarray(cached[: prompt.shape[0]]), np.asarray(prompt))
    np.testing.assert_array_equal(np.asarray(cached), np.asarray(uncached))
    count("cached == uncached")


@SETTINGS
@given(case=cases(), data=st.data())
def test_stepwise_equals_prefill_equals_full_forward(case, data):
    index, seed, prompt, _, _, _, _ = case
    model = model_for(index, seed)
    max_len = model.max_len
    ids = jnp.asarray(prompt[0])
    n = ids.shape[0]
    want = full(model, jnp.zeros((max_len,), jnp.int32).at[:n].set(ids))[:n]  # causal

    cache = model.init_cache()
    rows = []
    for t in range(n):
        logits, cache = step(model, ids[t], cache, jnp.asarray(t, jnp.int32))
        rows.append(logits)
    np.testing.assert_allclose(np.asarray(jnp.stack(rows)), np.asarray(want), atol=1e-5, rtol=0)

    # Prefill in two pieces, each padded with junk to a fixed width (no recompile per
    # length); the second piece starts at an offset and overwrites the first one's pads.
    width = max_len // 2
    split = data.draw(st.integers(max(1, n - width), max(1, min(width, n - 1))), label="split")
    junk = jnp.asarray(data.draw(st.integers(0, model.vocab_size - 1), label="junk"), jnp.int32)
    first = jnp.full((width,), junk).at[: min(split, n)].set(ids[:split])
    logits, cache = prefill(model, first, model.init_cache(), jnp.asarray(0, jnp.int32))
    got = [logits[: min(split, n)]]
    if split < n:
        second = jnp.full((width,), junk).at[: n - split].set(ids[split:])
        logits, cache = prefill(model, second, cache, jnp.asarray(split, jnp.int32))
        got.append(logits[: n - split])
    np.testing.assert_allclose(
        np.asarray(jnp.concatenate(got)), np.asarray(want), atol=1e-5, rtol=0
    )
    if n < max_len:  # the cache the pieces left behind serves the next step
        logits, _ = step(model, ids[0], cache, jnp.asarray(n, jnp.int32))
        extended = jnp.zeros((max_len,), jnp.int32).at[:n].set(ids).at[n].set(ids[0])
        np.testing.assert_allclose(
            np.asarray(logits), np.asarray(full(model, extended)[n]), atol=1e-5, rtol=0
        )
    count("stepwise == prefill == full")


@pytest.mark.filterwarnings("ignore::eqrope.TruncationWarning")  # as above
@SETTINGS
@given(case=cases(batch=2), use_eos=st.booleans())
def test_batched_equals_per_row(case, use_eos):
    index, seed, prompt, lengths, max_new, sampling, chunk = case
    model = model_for(index, seed)
    eos = int(prompt[0, 0]) if use_eos else None
    out = eqrope.generate(
        model,
        jnp.asarray(prompt),
        max_new,
        prompt_lengths=jnp.asarray(lengths),
        prefill_chunk=chunk,
        eos_id=eos,
        pad_id=0,
        **sampling,
    )
    keys = jax.random.split(sampling["key"], 2) if "key" in sampling else [None, None]
    for i in range(2):
        alone = eqrope.generate(
            model,
            jnp.asarray(prompt[i, : lengths[i]]),
            max_new,
            prefill_chunk=chunk,
            eos_id=eos,
            pad_id=0,
            **dict(sampling, key=keys[i]),
        )
        n = alone.shape[0]
        np.testing.assert_array_equal(np.asarray(out[i, :n]), np.asarray(alone))
        np.testing.assert_array_equal(np.asarray(out[i, n:]), 0)
    count("batched == per-row")
