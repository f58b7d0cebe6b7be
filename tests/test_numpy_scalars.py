"""Issue 43 (round 5), item 4: every number check accepts NumPy scalars.

A NumPy integer or float (`np.int32`, `np.int64`, `np.float32`, `np.float64`), or a 0-d
array of one, is the number it holds wherever eqrope takes a number: the checks share
`_checks.as_scalar`, and the signatures `_custom_types.IntLike` / `RealLike` (the tests
run under beartype, which read a plain `int` annotation as "not NumPy"). Each test runs
the call with NumPy numbers and with the Python numbers they hold, and compares the
results. Bools stay refused, and a NumPy NaN or an out-of-range NumPy number is refused
with the message its Python twin gets.
"""

import inspect

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tokenizers
from _models import random_model

import eqrope
from eqrope._checks import check_float, check_int
from eqrope.rl._rewards import host_rewards


# Three spellings of a number besides Python's: 32-bit and 64-bit NumPy scalars, and a
# 0-d array (of the default dtype: int64, float64).
FORMS = {
    "32-bit": (np.int32, np.float32),
    "64-bit": (np.int64, np.float64),
    "0-d array": (np.array, np.array),
}


@pytest.fixture(params=list(FORMS))
def form(request):
    """`form(value)`: `value` in NumPy's spelling (in dicts, lists and tuples too)."""
    as_int, as_float = FORMS[request.param]

    def spell(value):
        if isinstance(value, dict):
            return {k: spell(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(spell(v) for v in value)
        if isinstance(value, bool) or value is None or isinstance(value, str):
            return value
        return as_int(value) if isinstance(value, int) else as_float(value)

    return spell


def plain(value):
    """The Python number a NumPy number holds (in dicts, lists and tuples too)."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain(v) for v in value)
    return np.asarray(value).item() if isinstance(value, (np.generic, np.ndarray)) else value


@pytest.fixture(scope="module")
def model():
    return random_model(0, 8, 16, 2, 1, 16)


PROMPT = np.array([[1, 2, 3, 4], [5, 6, 7, 0]], np.int32)
SETTINGS = dict(
    max_new=6, temperature=0.7, top_k=6, top_p=0.9, min_p=0.05, repetition_penalty=1.2,
    presence_penalty=0.3, frequency_penalty=0.2, eos_id=7, pad_id=0, min_new=1, bad_ids=[5],
    stop=[[3, 4]], num_samples=2,
)  # fmt: skip


# -- generation ------------------------------------------------------------------------


def test_generate_takes_numpy_settings(model, form):
    # Sampling runs in float32: np.float32(0.7) samples as 0.7 does.
    key = jax.random.key(3)
    got = eqrope.generate(model, PROMPT, **form(SETTINGS), max_len=form(16), prefill_chunk=form(2), key=key)
    want = eqrope.generate(model, PROMPT, **SETTINGS, max_len=16, prefill_chunk=2, key=key)
    np.testing.assert_array_equal(got, want)
    assert len(np.unique(np.asarray(want))) > 3  # sampled, not a constant


def test_generate_takes_numpy_speculative_settings(model, form):
    prompt = np.array([1, 2, 3, 1, 2, 3, 1], np.int32)
    lookup = eqrope.PromptLookup(max_ngram=form(3), min_ngram=form(2))
    assert lookup == eqrope.PromptLookup(max_ngram=3, min_ngram=2)
    got = eqrope.generate(model, prompt, form(5), draft=lookup, draft_len=form(2))
    want = eqrope.generate(model, prompt, 5, draft=eqrope.PromptLookup(3, 2), draft_len=2)
    np.testing.assert_array_equal(got, want)


def test_generation_config_stores_python_numbers(form):
    config = eqrope.GenerationConfig(**form(SETTINGS))
    assert config == eqrope.GenerationConfig(**plain(form(SETTINGS)))
    for name in ("max_new", "top_k", "pad_id", "min_new", "num_samples"):
        assert type(getattr(config, name)) is int, name
    assert type(config.temperature) is float and config.eos_id == 7 and config.bad_ids == (5,)


class NumpyLengths(eqx.Module):
    """A model `ids -> logits` whose `max_len` and `vocab_size` are NumPy integers."""

    model: eqrope.RotaryDecoder

    @property
    def max_len(self):
        return np.int64(self.model.max_len)

    @property
    def vocab_size(self):
        return np.array(self.model.vocab_size)  # a 0-d array

    def __call__(self, ids):
        return self.model(ids)


def test_a_model_whose_lengths_are_numpy_integers(model):
    from eqrope.testing import Uncached

    np.testing.assert_array_equal(
        eqrope.generate(NumpyLengths(model), PROMPT[0], 3), eqrope.generate(Uncached(model), PROMPT[0], 3)
    )
    got, want = eqrope.score(NumpyLengths(model), PROMPT), eqrope.score(Uncached(model), PROMPT)
    np.testing.assert_array_equal(got.logprobs, want.logprobs)


# -- the engine ------------------------------------------------------------------------


def test_engine_takes_numpy_arguments_and_settings(model, form):
    arguments = dict(
        slots=2, page_size=4, pages=9, max_len=16, prefill_chunk=8, prefill_rows=2,
        decode_steps=3, decode_buckets=(1, 2), max_waiting=5, max_eos_ids=2, max_bad_ids=2,
        max_stop=2, max_stop_len=2,
    )  # fmt: skip
    engine = eqrope.Engine(model, **form(arguments))
    reference = eqrope.Engine(model, **arguments)
    for name in ("slots", "page_size", "max_len", "prefill_chunk", "prefill_rows", "decode_steps", "max_waiting"):
        assert type(getattr(engine, name)) is int and getattr(engine, name) == getattr(reference, name)
    assert engine.caps == reference.caps and engine.decode_buckets == reference.decode_buckets == (1, 2)
    settings = {k: v for k, v in SETTINGS.items() if k != "num_samples"}
    got = engine.generate([PROMPT[0]], [eqrope.GenerationConfig(**form(settings))])
    want = reference.generate([PROMPT[0]], [eqrope.GenerationConfig(**settings)])
    np.testing.assert_array_equal(got[0].tokens, want[0].tokens)


# -- the model -------------------------------------------------------------------------


def _config(spell):
    return eqrope.DecoderConfig(
        vocab_size=spell(8), d_model=spell(16), n_heads=spell(2), n_blocks=spell(2),
        max_len=spell(16), d_ff=spell(24), n_kv_heads=spell(1), rope_base=spell(500.0),
        norm_eps=spell(1e-5),
        attention=eqrope.AttentionOptions(head_dim=spell(4), window=spell(4), window_blocks=[spell(0)]),
        rope_scaling=eqrope.RopeScaling(
            "llama3", factor=spell(2.0), low_freq_factor=spell(1.0), high_freq_factor=spell(4.0),
            original_max_len=spell(8),
        ),
    )  # fmt: skip


def test_model_config_takes_numpy_numbers(form):
    config = _config(form)
    assert config == _config(lambda v: plain(form(v)))
    assert type(config.vocab_size) is int and type(config.norm_eps) is float
    assert type(config.attention.window) is int and type(config.rope_scaling.factor) is float


def test_the_decoder_takes_numpy_sizes(model, form):
    built = eqrope.RotaryDecoder(form(8), form(16), form(2), form(1), form(16), key=jax.random.key(0))
    assert built.config == eqrope.RotaryDecoder(8, 16, 2, 1, 16, key=jax.random.key(0)).config
    cache = model.init_cache(batch=form(2), max_len=form(8), chunk=form(4))
    assert cache.keys.shape == model.init_cache(batch=2, max_len=8, chunk=4).keys.shape


def test_rope_and_cache_sizes_take_numpy_numbers(form):
    inv_freq = eqrope.rope_inv_freq(form(8), form(500.0))
    np.testing.assert_array_equal(inv_freq, eqrope.rope_inv_freq(8, plain(form(500.0))))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 2, 8)), jnp.float32)
    positions = jnp.arange(3)
    np.testing.assert_array_equal(
        eqrope.apply_rope(x, positions, inv_freq, form(1.5)), eqrope.apply_rope(x, positions, inv_freq, 1.5)
    )
    config = _config(lambda v: v)
    size = eqrope.cache_nbytes(config, batch=form(3), positions=form(5))
    assert type(size) is int and size == eqrope.cache_nbytes(config, batch=3, positions=5)
    cache = eqrope.KVCache.empty(config, batch=form(2), max_len=form(8), chunk=form(4))
    assert cache.keys.shape == eqrope.KVCache.empty(config, batch=2, max_len=8).keys.shape
    assert cache.chunk == 4


def test_from_hf_takes_a_numpy_max_len(tmp_path, form):
    eqrope.to_hf(random_model(0, 8, 16, 2, 1, 16, head_bias=False), tmp_path)
    assert eqrope.from_hf(tmp_path, max_len=form(8)).config == eqrope.from_hf(tmp_path, max_len=8).config


# -- scoring, training, adapters, RL, sharding, text ----------------------------------


def test_score_and_the_loss_take_numpy_numbers(model, form):
    tokens = np.tile(np.arange(8, dtype=np.int32), (2, 2))
    got = eqrope.score(model, tokens, window=form(8), stride=form(4), batch_size=form(2))
    want = eqrope.score(model, tokens, window=8, stride=4, batch_size=2)
    np.testing.assert_array_equal(got.logprobs, want.logprobs)
    ids = jnp.asarray(tokens[:, :-1])
    targets = jnp.asarray(tokens[:, 1:])
    assert eqrope.cross_entropy(model, ids, targets, ignore_id=form(3)) == eqrope.cross_entropy(
        model, ids, targets, ignore_id=3
    )


def test_adapters_take_numpy_numbers(model, form):
    key = jax.random.key(1)
    adapted = eqrope.lora(model, rank=form(2), alpha=form(4.0), dropout=form(0.0), key=key)
    reference = eqrope.lora(model, rank=2, alpha=plain(form(4.0)), dropout=0.0, key=key)
    assert eqx.tree_equal(adapted, reference)
    other = eqrope.lora(model, rank=2, alpha=4.0, key=jax.random.key(2))
    stacked = eqrope.stack_adapters([reference, other])
    assert eqx.tree_equal(eqrope.take_adapter(stacked, form(1)), eqrope.take_adapter(stacked, 1))
    for index in (form(2), form(-1), True):
        with pytest.raises(ValueError, match=r"take_adapter: index must be an int in \[0, 2\)"):
            eqrope.take_adapter(stacked, index)


def _reward(tokens, prompt_lengths, ends):
    return jnp.zeros(tokens.shape[:2], jnp.float32)


def test_rl_takes_numpy_numbers(form):
    arguments = dict(
        group_size=2, max_new=3, temperature=0.8, beta=0.1, clip_eps=0.2, clip_eps_high=0.3,
        updates=2, eos_id=1, max_len=16, top_k=5,
    )  # fmt: skip
    step = eqrope.make_grpo_step(optax.sgd(0.1), _reward, **form(arguments))
    assert repr(step) == repr(eqrope.make_grpo_step(optax.sgd(0.1), _reward, **plain(form(arguments))))
    rewards = jnp.asarray([[1.0, 2.0, 4.0]])
    np.testing.assert_array_equal(
        eqrope.group_advantages(rewards, eps=form(0.5)), eqrope.group_advantages(rewards, eps=0.5)
    )
    logprobs = jnp.asarray([[-1.0, -2.0], [-0.5, -3.0]])
    mask = jnp.asarray([[True, True], [True, False]])
    common = dict(eps_low=0.2, eps_high=0.2, averaging="token")
    terms = eqrope.grpo_objective(
        logprobs, logprobs - 0.1, None, jnp.asarray([1.0, -1.0]), mask, beta=form(0.0), max_new=form(2), **common
    )
    want = eqrope.grpo_objective(
        logprobs, logprobs - 0.1, None, jnp.asarray([1.0, -1.0]), mask, beta=0.0, max_new=2, **common
    )
    assert terms.loss == want.loss


def test_a_host_reward_may_return_a_numpy_or_jax_number():
    tokens = np.array([[[1, 2, 3], [1, 4, 5]]], np.int32)
    values = iter([np.float32(0.5), np.array(1.5), jnp.float32(-2.0), np.int64(3)])
    reward = eqrope.HostReward(lambda prompt, completion: next(values), lambda ids: str(ids))
    got = host_rewards(reward, tokens, np.array([1]), np.array([[3, 3]]))
    np.testing.assert_array_equal(got, [[0.5, 1.5]])
    got = host_rewards(reward, tokens, np.array([1]), np.array([[3, 3]]))
    np.testing.assert_array_equal(got, [[-2.0, 3.0]])


def test_make_mesh_takes_numpy_sizes(form):
    assert eqrope.make_mesh(data=form(1), model=form(1)).shape == eqrope.make_mesh(data=1, model=1).shape


@pytest.fixture(scope="module")
def backend():
    vocab = {"<unk>": 0, "</s>": 1, "<pad>": 2, "hi": 3}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return backend


def test_the_tokenizer_takes_numpy_ids(backend, form):
    tok = eqrope.Tokenizer(backend, eos_ids=(form(1),), pad_id=form(2))
    assert tok.eos_ids == (1,) and tok.pad_id == 2
    assert type(tok.eos_ids[0]) is int and type(tok.pad_id) is int


def test_generate_text_takes_a_numpy_max_new(model, backend, form):
    tok = eqrope.Tokenizer(backend, eos_ids=(1,))
    got = eqrope.generate_text(model, tok, "hi hi", form(3), top_k=form(2), temperature=form(0.5), key=jax.random.key(0))
    assert got == eqrope.generate_text(model, tok, "hi hi", 3, top_k=2, temperature=0.5, key=jax.random.key(0))


def test_the_lm_eval_model_takes_numpy_numbers(model, backend, form):
    pytest.importorskip("lm_eval")
    tok = eqrope.Tokenizer(backend, eos_ids=(1,))
    numbers = dict(batch_size=2, max_batch_size=8, max_length=16, max_gen_toks=5, seed=3, prefix_token_id=1)
    got = eqrope.eval.LM(model, tok, **form(numbers))
    want = eqrope.eval.LM(model, tok, **numbers)
    for name in ("batch_size_per_gpu", "max_batch_size", "_max_length", "_max_gen_toks", "custom_prefix_token_id"):
        assert type(getattr(got, name)) is int and getattr(got, name) == getattr(want, name), name
    assert jax.random.key_data(got._key).tolist() == jax.random.key_data(want._key).tolist()


# -- what stays refused ----------------------------------------------------------------


BOOLS = [True, np.bool_(True), np.array(True)]


@pytest.mark.parametrize("value", BOOLS, ids=["bool", "np.bool_", "0-d bool"])
def test_the_shared_checks_refuse_bools(value):
    with pytest.raises(TypeError, match=r"^n must be an int, got"):
        check_int(value, "n")
    with pytest.raises(TypeError, match=r"^x must be a finite number, got"):
        check_float(value, "x")


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda m: eqrope.generate(m, PROMPT, True), r"max_new must be an int >= 0"),
        (lambda m: eqrope.generate(m, PROMPT, 3, max_len=True), r"max_len must be a positive int"),
        (lambda m: eqrope.generate(m, PROMPT, 3, prefill_chunk=True), r"prefill_chunk must be a positive int"),
        (lambda m: eqrope.GenerationConfig(top_k=True), r"top_k must be a positive int or None"),
        (lambda m: eqrope.GenerationConfig(temperature=np.bool_(True)), r"temperature must be a number"),
        (lambda m: eqrope.GenerationConfig(eos_id=[1, True]), r"eos_id\[1\] must be an int"),
        (lambda m: eqrope.Engine(m, slots=True), r"slots must be a positive int"),
        (lambda m: eqrope.DecoderConfig(8, 16, 2, 1, True), r"max_len must be a positive int"),
        (lambda m: eqrope.lora(m, rank=True, key=jax.random.key(0)), r"rank must be a positive int"),
        (lambda m: eqrope.make_mesh(data=True), r"data must be a positive int or None"),
        # Refused now, taken as 1 before:
        (lambda m: eqrope.cache_nbytes(m, batch=True), r"cache_nbytes: batch must be a positive int"),
        (lambda m: eqrope.rope_inv_freq(True), r"rope_inv_freq: head_dim must be an int >= 2"),
    ],
)
def test_bools_stay_refused_by_name(model, call, message):
    with pytest.raises(TypeError, match=message):
        call(model)


def test_the_tokenizer_refuses_a_bool_or_a_fraction_as_an_id(backend):
    with pytest.raises(TypeError, match=r"Tokenizer: eos_ids\[0\] must be an int >= 0, got True"):
        eqrope.Tokenizer(backend, eos_ids=(True,))
    # Past beartype's annotations (which refuse them too under the tests), to the checks:
    init, tok = inspect.unwrap(eqrope.Tokenizer.__init__), object.__new__(eqrope.Tokenizer)
    with pytest.raises(TypeError, match=r"Tokenizer: pad_id must be an int >= 0 or None, got 2.5"):
        init(tok, backend, pad_id=2.5)  # was stored as 2
    with pytest.raises(TypeError, match=r"Tokenizer: eos_ids must be a sequence of token ids"):
        init(tok, backend, eos_ids=1)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda m: eqrope.generate(m, PROMPT, np.int64(-1)), r"max_new must be an int >= 0 or None, got -1\."),
        (lambda m: eqrope.GenerationConfig(temperature=np.float32("nan")), r"temperature must be >= 0"),
        (lambda m: eqrope.GenerationConfig(top_p=np.array(1.5)), r"top_p must be in \(0, 1\] or None"),
        (lambda m: eqrope.GenerationConfig(pad_id=np.int32(-2)), r"pad_id must be a token id >= 0, got -2\."),
        (lambda m: eqrope.generate(m, PROMPT, 3, eos_id=np.array(8)), r"eos_id must be a token id in \[0, vocab_size=8\)"),
        (lambda m: eqrope.DecoderConfig(8, 16, 2, 1, 16, rope_base=np.float64("inf")), r"rope_base must be a finite number"),
        (lambda m: eqrope.lora(m, alpha=np.array(np.nan), key=jax.random.key(0)), r"alpha must be a finite number"),
        (lambda m: eqrope.Engine(m, slots=np.int64(0)), r"slots must be a positive int, got 0\."),
    ],
)
def test_numpy_numbers_out_of_range_are_refused_as_python_ones(model, call, message):
    with pytest.raises(ValueError, match=message):
        call(model)
