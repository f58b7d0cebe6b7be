"""Factor 1 of every rope scaling leaves a trained model's logits unchanged.

The rates of each scaling are pinned against transformers' rope initialisation functions
in `tests/test_rope_scaling.py` (`test_rates_match_transformers` and
`test_dynamic_rates_match_transformers_at_max_len`, marked `hf`), and its
`test_factor_one_changes_nothing` checks the logits of a random RMSNorm/SwiGLU model. This
file checks the path `experiments/extrapolation.py` takes: the chapter's trained rotary
checkpoint (LayerNorm, GELU, biases), given another rope by `with_rope`
(`experiments/extrapolation_ropes.py`: rebuilt from the changed config, refilled with the
trained arrays), for every method the experiment runs, through the forward pass and
through cached greedy generation.

`dynamic` is the identity at factor 1 only for sequences up to `original_max_len`: beyond
it transformers' formula, `base * (factor * L / original - (factor - 1)) ** (d / (d - 2))`,
enlarges the base even at factor 1. So its model here has `max_len = original_max_len`.
"""

import importlib
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqrope


ROOT = Path(__file__).resolve().parent.parent
CHECKPOINTS = ROOT / "experiments" / "checkpoints" / "main"
ORIGINAL = 17  # the chapter's longest training sequence: 8 letters, SEP, 8 letters


@pytest.fixture(scope="module")
def extrapolation():
    """experiments/ is a folder of scripts that import each other by name."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(ROOT / "experiments"))
        yield importlib.import_module("extrapolation_ropes")


@pytest.fixture(scope="module")
def chapter_model():
    return eqrope.load(CHECKPOINTS / "rotary_seed0")


def _rope(extrapolation, model, method, factor=1.0, max_len=ORIGINAL):
    return extrapolation.with_rope(
        model, method, factor, base=10000.0, original_max_len=ORIGINAL, max_len=max_len
    )


def _reversal_prompts(n=12, seed=0):
    """Ragged prompts `string, SEP` for strings of 3 to 8 letters, right-padded with 11."""
    rng = np.random.default_rng(seed)
    strings = [rng.integers(0, 10, size=int(k)) for k in rng.integers(3, 9, size=n)]
    prompt = np.full((n, 9), 11, np.int32)
    for i, s in enumerate(strings):
        prompt[i, : len(s)], prompt[i, len(s)] = s, 10
    return jnp.asarray(prompt), jnp.asarray([len(s) + 1 for s in strings], jnp.int32)


@pytest.mark.parametrize("method", ["linear", "ntk", "dynamic", "yarn", "llama3"])
def test_factor_one_leaves_the_logits_unchanged(extrapolation, chapter_model, method):
    plain = _rope(extrapolation, chapter_model, "none")
    scaled = _rope(extrapolation, chapter_model, method)
    config = scaled.config
    # The scaling is really there (ntk at factor 1 is the base itself).
    if method == "ntk":
        assert config.rope_base == 10000.0 and config.rope_scaling is None
    else:
        assert config.rope_scaling.kind == method and config.rope_scaling.factor == 1.0
    np.testing.assert_allclose(
        np.asarray(eqrope.rope_inv_freq(16, config.rope_base, config.rope_scaling)),
        np.asarray(eqrope.rope_inv_freq(16)),
        rtol=1e-7,
    )
    # A whole reversal sequence of the longest training length: 8 letters, SEP, 8 letters.
    ids = jnp.asarray([3, 1, 4, 1, 5, 9, 2, 6, 10, 6, 2, 9, 5, 1, 4, 1, 3], jnp.int32)
    np.testing.assert_allclose(
        np.asarray(eqx.filter_jit(scaled)(ids)),
        np.asarray(eqx.filter_jit(plain)(ids)),
        rtol=1e-5,
        atol=1e-5,
    )
    # Cached greedy generation (prefill, then one step at a time): the same tokens.
    prompt, lengths = _reversal_prompts()
    expected = eqrope.generate(plain, prompt, 8, prompt_lengths=lengths)
    got = eqrope.generate(scaled, prompt, 8, prompt_lengths=lengths)
    assert np.asarray(got).tolist() == np.asarray(expected).tolist()


def test_with_rope_keeps_the_trained_arrays(extrapolation, chapter_model):
    """A new max_len and rope change static fields only: the arrays are the checkpoint's,
    and the model as loaded (max_len 25) gives the same logits as the one rebuilt for 33."""
    longer = _rope(extrapolation, chapter_model, "none", max_len=33)
    assert longer.config.max_len == 33
    assert all(a is b for a, b in zip(jax.tree.leaves(longer), jax.tree.leaves(chapter_model)))
    ids = jnp.asarray([1, 2, 3, 10, 3, 2, 1], jnp.int32)
    assert np.array_equal(np.asarray(longer(ids)), np.asarray(chapter_model(ids)))
    # The static NTK base change: base * factor ** (d / (d - 2)), d = head_dim = 16.
    ntk = _rope(extrapolation, chapter_model, "ntk", 2.0, max_len=33)
    assert ntk.config.rope_base == pytest.approx(10000.0 * 2.0 ** (16 / 14), rel=1e-12)
    # The rope is read from the attention modules' own static fields, not only the config.
    assert ntk.stacked().blocks.attn.rope_base == ntk.config.rope_base  # load: the decoding layout


def test_with_rope_refuses_a_learned_table(extrapolation):
    learned = eqrope.load(CHECKPOINTS / "learned_seed0")
    with pytest.raises(ValueError, match="only rotary models can be rescaled"):
        _rope(extrapolation, learned, "none", max_len=33)
