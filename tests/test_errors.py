"""Bad input gets a clear error that names the argument, eagerly and inside `jit`.

Under pytest the jaxtyping import hook (`--jaxtyping-packages=eqrope,...`) checks the
annotations before a function body runs, so a wrongly typed array raises jaxtyping's own
`TypeCheckError` (a `TypeError`) naming the parameter. The library's own messages are
checked by calling its check directly and, once, in a subprocess without the hook.

Value-dependent errors inside `jit` go through `eqx.error_if`, which raises
`equinox.EquinoxRuntimeError` (a `RuntimeError`) when the compiled program runs.
"""

import os
import subprocess
import sys
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import eqrope
from _models import random_model


pytestmark = pytest.mark.usefixtures("precision")

VOCAB, D_MODEL, HEADS, BLOCKS, MAX_LEN = 13, 16, 2, 1, 8


@pytest.fixture(scope="module")
def model():
    return random_model(0, VOCAB, D_MODEL, HEADS, BLOCKS, MAX_LEN, n_kv_heads=1, d_ff=32)


def ints(*values):
    return jnp.asarray(values, jnp.int32)


# -- model(ids) ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ids", [jnp.zeros(3, jnp.float32), jnp.zeros(3, jnp.bool_)], ids=["float", "bool"]
)
def test_non_integer_ids(model, ids):
    with pytest.raises(TypeError, match="ids"):
        model(ids)
    # The library's own check, which runs when the jaxtyping hook is off:
    with pytest.raises(TypeError, match=r"ids must hold integer token ids.*astype"):
        model._check_ids(ids, "ids")


def test_rank_2_ids(model):
    batch = jnp.zeros((2, 3), jnp.int32)
    with pytest.raises((TypeError, ValueError), match="ids"):
        model(batch)
    with pytest.raises(ValueError, match=r"ids must have rank 1.*jax\.vmap"):
        model._check_ids(batch, "ids")


def test_rank_2_ids_message_without_the_jaxtyping_hook(precision):
    code = textwrap.dedent(
        """
        import equinox as eqx, jax, jax.numpy as jnp
        import eqrope
        model = eqx.filter_eval_shape(
            lambda: eqrope.RotaryDecoder(13, 16, 2, 1, 8, key=jax.random.PRNGKey(0))
        )
        try:
            model(jnp.zeros((2, 3), jnp.int32))
        except ValueError as e:
            print("MESSAGE:", e)
        """
    )
    env = dict(os.environ, JAX_ENABLE_X64="1" if precision == "x64" else "0")
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env=env,
    )
    assert "MESSAGE: ids must have rank 1" in result.stdout
    assert "jax.vmap(model)" in result.stdout


def test_empty_sequence(model):
    with pytest.raises(ValueError, match=r"ids is empty"):
        model(jnp.zeros((0,), jnp.int32))


def test_sequence_longer_than_max_len(model):
    with pytest.raises(ValueError, match=r"ids has 9 tokens but max_len=8"):
        model(jnp.zeros((MAX_LEN + 1,), jnp.int32))


@pytest.mark.parametrize("bad", [-1, VOCAB, VOCAB + 100], ids=["negative", "vocab", "beyond"])
def test_token_out_of_vocab_eager(model, bad):
    with pytest.raises(ValueError, match=rf"ids holds token ids outside \[0, {VOCAB}\)"):
        model(ints(1, bad, 2))


@pytest.mark.parametrize("bad", [-1, VOCAB])
def test_token_out_of_vocab_under_jit_raises(model, bad):
    good = ints(1, 2, 3)
    filter_jitted = eqx.filter_jit(lambda m, ids: m(ids))
    jitted = jax.jit(lambda ids: model(ids))
    # The same compiled programs run on good ids, so the error depends on the values.
    assert filter_jitted(model, good).shape == (3, VOCAB)
    assert jitted(good).shape == (3, VOCAB)
    message = rf"ids holds a token id outside \[0, vocab_size={VOCAB}\)"
    with pytest.raises(eqx.EquinoxRuntimeError, match=message):
        jax.block_until_ready(filter_jitted(model, ints(1, bad, 3)))
    # Under plain `jax.jit` Equinox cannot re-raise its own class: XLA's callback error
    # (a ValueError) carries the same message.
    with pytest.raises((eqx.EquinoxRuntimeError, ValueError), match=message):
        jax.block_until_ready(jitted(ints(1, bad, 3)))
    with pytest.raises(eqx.EquinoxRuntimeError, match=message):
        jax.block_until_ready(jax.vmap(model)(jnp.stack([good, ints(1, bad, 3)])))


def test_bad_token_to_step_and_prefill_under_jit(model):
    step = eqx.filter_jit(lambda m, t, c, p: m.step(t, c, p))
    prefill = eqx.filter_jit(lambda m, ids, c, p: m.prefill(ids, c, p))
    cache = model.init_cache()
    zero = jnp.asarray(0, jnp.int32)
    with pytest.raises(eqx.EquinoxRuntimeError, match="token"):
        jax.block_until_ready(step(model, jnp.asarray(VOCAB, jnp.int32), cache, zero))
    with pytest.raises(eqx.EquinoxRuntimeError, match="ids"):
        jax.block_until_ready(prefill(model, ints(0, -5), cache, zero))
    with pytest.raises(ValueError, match="token"):
        model.step(jnp.asarray(-1, jnp.int32), cache, 0)


# -- the constructor -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((13, 30, 4, 1, 8), {}, r"d_model=30 is not divisible by n_heads=4"),
        ((13, 12, 4, 1, 8), {}, r"head_dim = 3 is odd"),
        ((13, 24, 4, 1, 8), dict(n_kv_heads=3), r"n_heads=4 is not divisible by n_kv_heads=3"),
        ((0, 16, 2, 1, 8), {}, r"vocab_size must be a positive int"),
        ((13, -16, 2, 1, 8), {}, r"d_model must be a positive int"),
        ((13, 16, 0, 1, 8), {}, r"n_heads must be a positive int"),
        ((13, 16, 2, 0, 8), {}, r"n_blocks must be a positive int"),
        ((13, 16, 2, 1, 0), {}, r"max_len must be a positive int"),
        ((13, 16, 2, 1, 8), dict(d_ff=0), r"d_ff must be a positive int"),
        ((13, 16, 2, 1, 8), dict(n_kv_heads=0), r"n_kv_heads must be a positive int"),
        ((13, 16, 2, 1, 8), dict(n_kv_heads=-2), r"n_kv_heads must be a positive int"),
    ],
)
def test_bad_constructor_arguments(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        eqrope.RotaryDecoder(*args, **kwargs, key=jax.random.PRNGKey(0))


@pytest.mark.parametrize(
    "args, name", [((13, 16.0, 2, 1, 8), "d_model"), ((13, 16, 2, 1, True), "max_len")]
)
def test_non_int_sizes(args, name):
    # Under pytest jaxtyping/beartype reject a float first (a TypeError naming the
    # parameter); a bool is an int to them, and DecoderConfig's own ValueError names it.
    with pytest.raises((TypeError, ValueError), match=name):
        eqrope.RotaryDecoder(*args, key=jax.random.PRNGKey(0))
    config = dict(
        zip(("vocab_size", "d_model", "n_heads", "n_blocks", "max_len"), args, strict=True)
    )
    with pytest.raises((TypeError, ValueError), match=name):
        eqrope.DecoderConfig(**config)


# -- caches and positions --------------------------------------------------------------------


def other_cache(**changes):
    sizes = dict(vocab_size=VOCAB, d_model=D_MODEL, n_heads=HEADS, n_blocks=BLOCKS, max_len=MAX_LEN)
    options = dict(n_kv_heads=1, d_ff=32)
    sizes.update({k: v for k, v in changes.items() if k in sizes})
    options.update({k: v for k, v in changes.items() if k not in sizes})
    skeleton = eqx.filter_eval_shape(
        lambda: eqrope.RotaryDecoder(*sizes.values(), **options, key=jax.random.PRNGKey(0))
    )
    return skeleton.init_cache()  # reads only the static config


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(n_blocks=2), r"cache has shape"),
        (dict(max_len=16), r"cache has shape"),
        (dict(n_kv_heads=2), r"cache has shape"),
        (dict(d_model=32, n_heads=2), r"cache has shape"),
        (dict(dtype="bfloat16"), r"cache has dtype bfloat16"),
    ],
)
def test_cache_for_another_model(model, changes, match):
    cache = other_cache(**changes)
    with pytest.raises(ValueError, match=match):
        model.step(ints(1)[0], cache, 0)
    with pytest.raises(ValueError, match=match):
        model.prefill(ints(1, 2), cache, 0)


def test_batched_cache_or_not_a_cache(model):
    with pytest.raises(ValueError, match=r"cache has shape"):
        model.prefill(ints(1, 2), model.init_cache(batch=2), 0)
    with pytest.raises(TypeError, match=r"cache"):
        model.prefill(ints(1, 2), (jnp.zeros(3), jnp.zeros(3)), 0)


@pytest.mark.parametrize("pos, seq", [(7, 2), (8, 1), (-1, 1), (0, 9)])
def test_prefill_past_max_len_eager(model, pos, seq):
    ids = jnp.zeros((seq,), jnp.int32)
    with pytest.raises(ValueError, match=r"max_len"):
        model.prefill(ids, model.init_cache(), pos)


def test_prefill_and_step_past_max_len_traced(model):
    prefill = eqx.filter_jit(lambda m, ids, c, p: m.prefill(ids, c, p))
    step = eqx.filter_jit(lambda m, t, c, p: m.step(t, c, p))
    # Every row written, so that no position below max_len leaves a gap.
    _, cache = model.prefill(jnp.zeros((MAX_LEN,), jnp.int32), model.init_cache())
    ids = ints(1, 2, 3)
    logits, _ = prefill(model, ids, cache, jnp.asarray(5, jnp.int32))  # 5 + 3 = 8: fits
    assert logits.shape == (3, VOCAB)
    for pos in (6, -1):
        with pytest.raises(
            eqx.EquinoxRuntimeError, match=r"pos \+ sequence length must be within max_len=8"
        ):
            jax.block_until_ready(prefill(model, ids, cache, jnp.asarray(pos, jnp.int32)))
    with pytest.raises(eqx.EquinoxRuntimeError, match=r"max_len=8"):
        jax.block_until_ready(step(model, ints(1)[0], cache, jnp.asarray(MAX_LEN, jnp.int32)))


def test_position_must_be_an_integer(model):
    with pytest.raises(TypeError, match=r"pos"):
        model.prefill(ints(1), model.init_cache(), 1.5)
    with pytest.raises(TypeError, match=r"pos"):
        model.prefill(ints(1), model.init_cache(), True)


# -- generate --------------------------------------------------------------------------------

KEY = jax.random.PRNGKey(0)


@pytest.mark.parametrize(
    "prompt, kwargs, error, match",
    [
        (jnp.zeros((0,), jnp.int32), {}, ValueError, r"prompt is empty"),
        (jnp.zeros((2, 0), jnp.int32), {}, ValueError, r"prompt is empty"),
        (
            jnp.zeros((MAX_LEN + 1,), jnp.int32),
            {},
            ValueError,
            r"prompt has 9 tokens but the model's max_len is 8",
        ),
        (jnp.zeros((3,), jnp.float32), {}, TypeError, r"prompt must hold integer token ids"),
        (jnp.zeros((3,), jnp.bool_), {}, TypeError, r"prompt must hold integer token ids"),
        (jnp.zeros((1, 2, 3), jnp.int32), {}, ValueError, r"prompt must have rank 1 or 2"),
        (ints(1, -1), {}, ValueError, r"prompt holds token ids outside \[0, 13\)"),
        (ints(1, VOCAB), {}, ValueError, r"prompt holds token ids outside \[0, 13\)"),
        (ints(1, 2), dict(max_new=-1), ValueError, r"max_new must be an int >= 0"),
        (ints(1, 2), dict(max_new=2.0), TypeError, r"max_new"),
        (ints(1, 2), dict(temperature=-0.5, key=KEY), ValueError, r"temperature must be >= 0"),
        (
            ints(1, 2),
            dict(temperature=float("nan"), key=KEY),
            ValueError,
            r"temperature must be >= 0",
        ),
        (ints(1, 2), dict(temperature=0.7), ValueError, r"temperature > 0.*key"),
        (ints(1, 2), dict(top_k=0), ValueError, r"top_k must be a positive int"),
        (ints(1, 2), dict(top_k=-3), ValueError, r"top_k must be a positive int"),
        (ints(1, 2), dict(top_k=2.5), (TypeError, ValueError), r"top_k"),
        (ints(1, 2), dict(top_p=0.0), ValueError, r"top_p must be in \(0, 1\]"),
        (ints(1, 2), dict(top_p=1.5), ValueError, r"top_p must be in \(0, 1\]"),
        (ints(1, 2), dict(top_p=-0.1), ValueError, r"top_p must be in \(0, 1\]"),
        (ints(1, 2), dict(top_p=float("nan")), ValueError, r"top_p must be in \(0, 1\]"),
        (ints(1, 2), dict(eos_id=VOCAB), ValueError, r"eos_id must be a token id"),
        (ints(1, 2), dict(eos_id=-1), ValueError, r"eos_id must be a token id"),
        (
            ints(1, 2),
            dict(prompt_lengths=ints(2)),
            ValueError,
            r"prompt_lengths is only for a batched",
        ),
        (
            jnp.ones((2, 3), jnp.int32),
            dict(prompt_lengths=ints(3)),
            ValueError,
            r"prompt_lengths has 1 entries but prompt has 2 rows",
        ),
        (
            jnp.ones((2, 3), jnp.int32),
            dict(prompt_lengths=ints(3, 4)),
            ValueError,
            r"prompt_lengths must be in \[1, 3\]",
        ),
        (
            jnp.ones((2, 3), jnp.int32),
            dict(prompt_lengths=ints(0, 2)),
            ValueError,
            r"prompt_lengths must be in \[1, 3\]",
        ),
        (
            jnp.ones((2, 3), jnp.int32),
            dict(prompt_lengths=jnp.ones((2,), jnp.float32)),
            TypeError,
            r"prompt_lengths must hold integer",
        ),
        (
            jnp.ones((2, 3), jnp.int32),
            dict(prompt_lengths=jnp.ones((2, 1), jnp.int32)),
            ValueError,
            r"prompt_lengths must have rank 1",
        ),
        (
            ints(1, 2),
            dict(key=jnp.zeros((3,), jnp.uint32), temperature=1.0),
            TypeError,
            r"key must be one PRNG key",
        ),
        (ints(1, 2), dict(prefill_chunk=0), ValueError, r"prefill_chunk must be a positive int"),
    ],
)
def test_generate_rejects(model, prompt, kwargs, error, match):
    kwargs = dict(kwargs)
    max_new = kwargs.pop("max_new", 3)
    with pytest.raises(error, match=match):
        eqrope.generate(model, prompt, max_new, **kwargs)


def test_generate_checks_the_real_tokens_of_a_ragged_prompt(model):
    prompt = jnp.asarray([[1, 2, 99], [3, 4, 5]], jnp.int32)
    with pytest.raises(ValueError, match=r"prompt holds token ids outside \[0, 13\): \[99\]"):
        eqrope.generate(model, prompt, 2, prompt_lengths=ints(3, 3))


def test_generate_needs_a_max_len():
    class NoMaxLen:
        def __call__(self, ids):
            return jnp.zeros((ids.shape[0], 5))

    with pytest.raises(TypeError, match=r"max_len"):
        eqrope.generate(NoMaxLen(), ints(1, 2), 3)


def test_uncached_path_rejects_out_of_vocab_prompt(model):
    class Plain(eqx.Module):
        inner: eqrope.RotaryDecoder
        max_len: int = eqx.field(static=True)

        def __call__(self, ids):
            return self.inner(ids)

    # Plain has no vocab_size, so generate cannot check the prompt itself: the model must.
    with pytest.raises((ValueError, eqx.EquinoxRuntimeError), match=r"token id"):
        eqrope.generate(Plain(model, MAX_LEN), ints(1, VOCAB + 3), 2)


# -- one int check for every integer argument ------------------------------------------------


@pytest.mark.parametrize("value", [True, 2.0, "4", None])
def test_integer_arguments_refuse_bools_floats_and_strings(model, value):
    """Every integer argument goes through one check, so they refuse the same things
    (before it, `prefill_chunk=True` was taken as 1)."""
    calls = {
        "prefill_chunk": lambda: eqrope.generate(model, ints(1, 2), 2, prefill_chunk=value),
        "max_new": lambda: eqrope.generate(model, ints(1, 2), value),
        "batch": lambda: model.init_cache(value) if value is not None else model.init_cache("x"),
        "chunk": lambda: model.init_cache(chunk=value),
        "d_ff": lambda: eqrope.DecoderConfig(13, 16, 2, 1, 8, d_ff=value if value else "x"),
    }
    for name, call in calls.items():
        with pytest.raises((TypeError, ValueError), match=name):
            call()


def test_unknown_decoder_option_is_named():
    with pytest.raises(TypeError, match=r"unknown options \['colour'\].*n_kv_heads"):
        eqrope.RotaryDecoder(13, 16, 2, 1, 8, colour="red", key=jax.random.PRNGKey(0))


def test_from_config_rebuilds_the_same_config():
    config = eqrope.DecoderConfig(13, 16, 2, 1, 8, n_kv_heads=1, tie_embeddings=True, dtype=jnp.bfloat16)
    model = eqrope.RotaryDecoder.from_config(config, key=jax.random.PRNGKey(0))
    assert model.config == config and config.dtype == "bfloat16"
    assert model.embed.dtype == jnp.bfloat16 and model.head is None
