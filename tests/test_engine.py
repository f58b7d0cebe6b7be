"""eqrope.Engine against `generate` of each request alone, and its invariance.

Every comparison is with `eqrope.generate` (the static-cache path, another program, another
attention walk) of the same request alone: greedy tokens, and sampled tokens with the
request's key. One engine configuration per module fixture, so that each compiles its few
programs once.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _compiles import counting
from _models import random_model

import eqrope
from eqrope import GenerationConfig as Config


VOCAB, MAX_LEN = 61, 64
# One pool size for every engine here, so that engines of other slot counts share the
# prefill programs (a program's shapes: the pool, the pieces).
ENGINE = dict(page_size=4, pages=65, max_len=MAX_LEN, prefill_chunk=16, prefill_rows=2, decode_steps=6)


@pytest.fixture(scope="module")
def model():
    return random_model(3, VOCAB, 32, 4, 2, MAX_LEN, n_kv_heads=2, d_ff=48)


@pytest.fixture(scope="module")
def engine(model):
    return eqrope.Engine(model, slots=4, decode_buckets=(4,), **ENGINE)


def prompts(n, seed=0, low=2, high=30):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, size=int(k)).astype(np.int32) for k in rng.integers(low, high, size=n)]


def alone(model, prompt, config, key=None):
    """`generate` of one request: its new tokens (to its end) and their log-probabilities."""
    g = eqrope.generate(model, prompt, config=config, key=key, return_logprobs=True)
    end = int(g.lengths)
    new = slice(len(prompt), end)
    return np.asarray(g.tokens)[new], np.asarray(g.logprobs)[new]


# One request per setting, greedy and sampled; `generate` runs each alone.
SETTINGS = {
    "greedy": Config(max_new=9),
    "repetition": Config(max_new=9, repetition_penalty=1.7),
    "presence": Config(max_new=9, presence_penalty=1.5),
    "frequency": Config(max_new=9, frequency_penalty=0.8),
    "bad_ids": Config(max_new=9, bad_ids=[1, 2, 3, 5, 8, 13, 21, 34]),
    "eos": Config(max_new=20, eos_id=[7, 11, 19, 23, 29, 31, 37, 41]),
    "eos_min_new": Config(max_new=20, eos_id=[7, 11, 19, 23, 29, 31, 37, 41], min_new=6),
    "stop": Config(max_new=20, stop=[[4, 9], [12], [30, 31, 32]]),
    "temperature": Config(max_new=12, temperature=0.9),
    "top_k": Config(max_new=12, temperature=1.2, top_k=5),
    "top_p": Config(max_new=12, temperature=1.0, top_p=0.6),
    "min_p": Config(max_new=12, temperature=1.5, min_p=0.2),
    "everything": Config(
        max_new=14, temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.2,
        presence_penalty=0.3, frequency_penalty=0.2, bad_ids=[0], eos_id=[5, 6], min_new=2,
        stop=[[3, 3]],
    ),
}


@pytest.fixture(scope="module")
def mixed(engine, model):
    """Every setting in one engine call (neighbours with other settings), and alone."""
    names = list(SETTINGS)
    ps = prompts(len(names), seed=1)
    keys = [jax.random.key(100 + i) for i in range(len(names))]
    out = engine.generate(ps, [SETTINGS[n] for n in names], keys=keys)
    ref = [alone(model, p, SETTINGS[n], k) for p, n, k in zip(ps, names, keys)]
    return dict(zip(names, zip(out, ref)))


@pytest.mark.parametrize("name", list(SETTINGS))
def test_each_setting_matches_generate_alone(mixed, name):
    completion, (tokens, logprobs) = mixed[name]
    np.testing.assert_array_equal(completion.tokens, tokens)
    np.testing.assert_allclose(completion.logprobs, logprobs, rtol=1e-5, atol=1e-5)
    assert completion.tokens.dtype == np.int32 and completion.logprobs.dtype == np.float32


def test_finish_reasons_are_read_from_the_text(mixed):
    reasons = {name: mixed[name][0].finish_reason for name in mixed}
    assert reasons["greedy"] == "length" and len(mixed["greedy"][0].tokens) == 9
    for name, ids in (("eos", SETTINGS["eos"].eos_id), ("eos_min_new", SETTINGS["eos"].eos_id)):
        tokens = mixed[name][0].tokens
        ended = tokens[-1] in ids and len(tokens) < SETTINGS[name].max_new
        assert reasons[name] == ("eos" if ended else "length")
    assert reasons["stop"] in ("stop", "length")
    if reasons["stop"] == "stop":
        tail = mixed["stop"][0].tokens.tolist()
        assert any(tail[-len(s) :] == list(s) for s in SETTINGS["stop"].stop)
    # min_new holds the EOS back for 6 tokens.
    assert not set(mixed["eos_min_new"][0].tokens[:6].tolist()) & set(SETTINGS["eos"].eos_id)


def test_num_samples_share_a_prefill_and_match_generate(engine, model):
    prompt = prompts(1, seed=2, low=10, high=11)[0]  # 10 tokens: two full pages and a partial one
    config = Config(max_new=8, temperature=1.0, num_samples=3)
    key = jax.random.key(7)
    (samples,) = engine.generate([prompt], config, keys=[key])
    g = eqrope.generate(model, prompt, config=config, key=key)
    assert len(samples) == 3
    for j, completion in enumerate(samples):
        np.testing.assert_array_equal(completion.tokens, np.asarray(g)[j, len(prompt) :])
    assert len({tuple(c.tokens.tolist()) for c in samples}) > 1


def test_tokens_do_not_depend_on_slots_order_or_neighbours(engine, model):
    ps = prompts(6, seed=3)
    configs = [Config(max_new=int(n), temperature=t) for n, t in zip([5, 17, 3, 11, 8, 13], [0, 1, 0, 0.7, 1.3, 0])]
    keys = [jax.random.key(i) for i in range(6)]
    first = engine.generate(ps, configs, keys=keys)
    order = [4, 2, 0, 5, 1, 3]
    shuffled = engine.generate([ps[i] for i in order], [configs[i] for i in order], keys=[keys[i] for i in order])
    # The same requests among other neighbours, with another slot count.
    two = eqrope.Engine(model, slots=2, decode_buckets=(2,), **ENGINE)
    extra = prompts(4, seed=9)
    crowded = two.generate(extra[:2] + ps + extra[2:], [Config(max_new=4)] * 2 + configs + [Config(max_new=4)] * 2,
                           keys=[jax.random.key(50)] * 2 + keys + [jax.random.key(51)] * 2)[2:-2]
    for i in range(6):
        assert np.array_equal(first[i].tokens, shuffled[order.index(i)].tokens)
        # The decode steps' log-probabilities are bitwise the same. The first token's comes
        # from the prefill, whose rows are grouped by arrival: on some CPUs (an Intel Xeon
        # here) XLA's matrix products round a row differently in another group, by an ulp.
        a, b = first[i].logprobs, shuffled[order.index(i)].logprobs
        assert np.array_equal(a[1:], b[1:])  # bitwise
        np.testing.assert_allclose(a[:1], b[:1], rtol=1e-6)
        assert np.array_equal(first[i].tokens, crowded[i].tokens)
        np.testing.assert_array_equal(first[i].tokens, alone(model, ps[i], configs[i], keys[i])[0])


def test_a_shared_prefix_is_computed_once(model):
    engine = eqrope.Engine(model, slots=4, decode_buckets=(4,), **ENGINE)
    rng = np.random.default_rng(4)
    system = rng.integers(0, VOCAB, size=37).astype(np.int32)  # 37: hits round down to 32 (two pieces)
    ps = [np.concatenate([system, rng.integers(0, VOCAB, size=k).astype(np.int32)]) for k in (3, 9, 1)]
    config = Config(max_new=5)
    first = engine.generate(ps[:1], config)
    assert engine.stats.prefix_hit_tokens == 0
    rest = engine.generate(ps[1:], config)
    # Each later prompt takes 32 positions (the whole pieces of the prefix) from the pool.
    assert engine.stats.prefix_hit_tokens == 2 * 32
    assert engine.stats.prompt_tokens_computed == len(ps[0]) + (len(ps[1]) - 32) + (len(ps[2]) - 32)
    for p, c in zip(ps, first + rest):
        np.testing.assert_array_equal(c.tokens, alone(model, p, config)[0])


def test_no_compiles_after_warm_up_across_a_new_mix(engine, mixed):
    ps = prompts(10, seed=5, low=1, high=40)
    configs = [
        dataclasses.replace(SETTINGS[name], max_new=int(n))
        for name, n in zip(list(SETTINGS)[:10], [3, 20, 7, 1, 9, 12, 2, 15, 6, 4])
    ]
    with counting() as c:
        engine.generate(ps, configs, keys=[jax.random.key(i) for i in range(10)])
    assert sum(c.compiles.values()) == 0, dict(c.compiles)


def test_online_calls_report_events_and_cancel_frees_at_once(model):
    engine = eqrope.Engine(model, slots=2, decode_buckets=(2,), **ENGINE)
    ps = prompts(3, seed=6, low=8, high=9)
    ids = [engine.submit(p, Config(max_new=30)) for p in ps]
    assert engine.stats.waiting == 3
    events = engine.step()
    assert engine.stats.running == 2 and engine.stats.waiting == 1
    held = engine.stats.pages_used
    engine.cancel(ids[0])
    assert engine.stats.running == 1 and engine.stats.pages_used < held
    events += engine.step()
    cancelled = [e for e in events if e.request_id == ids[0] and e.finished]
    assert [e.finish_reason for e in cancelled] == ["cancelled"]
    page_bytes = engine.stats.kv_bytes_per_token * ENGINE["page_size"]
    while engine.has_work():
        events += engine.step()
        # Memory follows the tokens: at most one partly written page per slot.
        s = engine.stats
        assert s.kv_bytes_held <= s.tokens_held * s.kv_bytes_per_token + engine.slots * page_bytes
    text = {i: np.concatenate([e.tokens for e in events if e.request_id == i]) for i in ids[1:]}
    for i, p in zip(ids[1:], ps[1:]):
        np.testing.assert_array_equal(text[i], alone(model, p, Config(max_new=30))[0])
    assert engine.stats.pages_used == 0 and engine.stats.running == 0
    with pytest.raises(KeyError, match="no request"):
        engine.cancel(ids[0])


def test_cancelling_one_sample_leaves_the_others_running(model):
    # A server's stop string matched in one sample's text: that sample ends, and the
    # others go on to the tokens they would have drawn anyway.
    engine = eqrope.Engine(model, slots=3, decode_buckets=(3,), **ENGINE)
    p = prompts(1, seed=9, low=8, high=9)[0]
    cfg = Config(max_new=20, temperature=1.0, num_samples=3)
    with pytest.raises(ValueError, match="before its samples start"):
        engine.cancel(engine.submit(p, cfg, key=jax.random.key(3)), sample=1)
    engine.cancel(0)
    request = engine.submit(p, cfg, key=jax.random.key(3))
    events = engine.step()
    held = engine.stats.pages_used
    engine.cancel(request, sample=1)
    assert engine.stats.running == 2 and engine.stats.pages_used < held
    with pytest.raises(ValueError, match="no running sample 3"):
        engine.cancel(request, sample=3)
    while engine.has_work():
        events += engine.step()
    reasons = {e.sample: e.finish_reason for e in events if e.finished}
    assert reasons == {0: "length", 1: "cancelled", 2: "length"}
    want = eqrope.Engine(model, slots=3, decode_buckets=(3,), **ENGINE).generate([p], cfg, keys=[jax.random.key(3)])[0]
    for sample in (0, 2):
        got = np.concatenate([e.tokens for e in events if e.sample == sample])
        np.testing.assert_array_equal(got, want[sample].tokens)
    assert engine.stats.pages_used == 0


def test_max_total_counts_each_prompt(engine, model):
    """transformers' max_length (a `generation_config.json` without max_new_tokens): the
    prompt and the new tokens together, per request."""
    short, long = prompts(2, seed=14, low=4, high=12)  # 5 and 10 tokens
    out = engine.generate([short, long], Config(max_total=16))
    for prompt, completion in zip((short, long), out):
        want, _ = alone(model, prompt, Config(max_new=16 - len(prompt)))
        np.testing.assert_array_equal(completion.tokens, want)
        assert len(prompt) + len(completion.tokens) == 16
    with pytest.raises(ValueError, match=f"max_total={len(short)} .*leaves no new token"):
        engine.submit(short, Config(max_total=len(short)))


def test_bad_input_is_refused_by_name(model):
    small = dict(ENGINE, pages=9)  # never stepped: nothing compiles for its pool
    engine = eqrope.Engine(model, slots=2, max_waiting=2, decode_buckets=(2,), **small)
    p = prompts(1, seed=7, low=5, high=6)[0]
    with pytest.raises(ValueError, match="max_len=64"):
        engine.submit(np.zeros(60, np.int32), Config(max_new=5))
    with pytest.raises(ValueError, match="more pages"):  # 8 pages of 4 hold 32 positions
        engine.submit(p, Config(max_new=40))
    with pytest.raises(ValueError, match="max_new"):
        engine.submit(p)
    with pytest.raises(TypeError, match="unknown settings \\['temprature'\\]"):
        engine.submit(p, Config(max_new=2), temprature=1.0)
    with pytest.raises(TypeError, match="max_new_tokens"):
        engine.submit(p, max_new_tokens=2)
    with pytest.raises(ValueError, match="outside"):
        engine.submit(np.array([1, VOCAB]), Config(max_new=2))
    with pytest.raises(ValueError, match="max_eos_ids=9"):
        engine.submit(p, Config(max_new=2, eos_id=list(range(9))))
    with pytest.raises(ValueError, match="num_samples=3 is more than"):
        engine.submit(p, Config(max_new=2, num_samples=3))
    with pytest.raises(ValueError, match="multiple of page_size"):
        eqrope.Engine(model, slots=2, page_size=5, prefill_chunk=16)


def test_a_full_queue_refuses_and_loses_nothing(model):
    engine = eqrope.Engine(model, slots=2, max_waiting=2, decode_buckets=(2,), **ENGINE)
    p = prompts(1, seed=7, low=5, high=6)[0]
    a, b = engine.submit(p, max_new=3), engine.submit(p, max_new=3)
    with pytest.raises(RuntimeError, match="waiting queue is full"):
        engine.submit(p, max_new=3)
    done = set()
    while engine.has_work():
        done |= {e.request_id for e in engine.step() if e.finished}
    assert done == {a, b}


def test_paged_rows_read_through_the_table():
    from eqrope.model._block_cache import BlockCache

    rng = np.random.default_rng(0)
    pool = rng.normal(size=(2, 6, 4, 3)).astype(np.float32)  # kv_heads, pages, page_size, head_dim
    table = np.array([3, 1, 5, 0], np.int32)
    view = BlockCache(jnp.asarray(pool), jnp.asarray(2 * pool), None, None, None, None, None, 8, jnp.asarray(table))
    assert view.max_len == 16
    keys, values = view.rows(4, 8)  # rows 4..11: pages 1 and 5
    expected = np.concatenate([pool[:, 1], pool[:, 5]], axis=1)
    np.testing.assert_array_equal(keys, expected)
    np.testing.assert_array_equal(values, 2 * expected)


def test_x64_mode_gives_the_same_tokens(model):
    ps = prompts(3, seed=8)
    configs = [Config(max_new=6), Config(max_new=9, temperature=1.0, top_k=7), Config(max_new=4, stop=[[3]])]
    keys = [jax.random.key(i) for i in range(3)]
    with jax.enable_x64(True):
        engine = eqrope.Engine(model, slots=2, decode_buckets=(2,), **ENGINE)
        out = engine.generate(ps, configs, keys=keys)
    for p, c, k, o in zip(ps, configs, keys, out):
        np.testing.assert_array_equal(o.tokens, alone(model, p, c, k)[0])


def test_memory_follows_the_tokens_held(model):
    """After every step, the pages held are at most the tokens held plus one partly
    written page per slot, though chunks end early (requests wait) after allocating
    their lookahead."""
    engine = eqrope.Engine(model, slots=2, decode_buckets=(2,), **ENGINE)
    for p, n in zip(prompts(6, seed=11, low=3, high=12), [3, 17, 5, 11, 2, 9]):
        engine.submit(p, max_new=n)
    page = engine.stats.kv_bytes_per_token * ENGINE["page_size"]
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
        s = engine.stats
        assert s.kv_bytes_held <= s.tokens_held * s.kv_bytes_per_token + engine.slots * page, steps
        for sample in engine.scheduler.running():  # each holds only the pages its rows fill
            assert len(sample.pages) == -(-(sample.pos - 1) // ENGINE["page_size"]), steps
    assert engine.stats.pages_used == 0


def test_no_compiles_across_a_thousand_mixed_requests(engine, mixed):
    """Issue 39's compile target: after the programs exist, 1,000 requests of every
    setting, length and sample count compile nothing."""
    rng = np.random.default_rng(12)
    names = list(SETTINGS)
    ps = prompts(1000, seed=12, low=1, high=50)
    configs = [
        dataclasses.replace(
            SETTINGS[names[i % len(names)]], max_new=int(rng.integers(1, 6)),
            num_samples=[None, None, None, 2, 3][i % 5],
        )
        for i in range(1000)
    ]
    engine.warmup()  # every program, and the keys of 2 and 3 samples
    with counting() as c:
        out = engine.generate(ps, configs, keys=[jax.random.key(i) for i in range(1000)])
    assert sum(c.compiles.values()) == 0, dict(c.compiles)
    assert len(out) == 1000 and all(len(o) == 3 for o in out[4::5])


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
@pytest.mark.parametrize("partitionable", [True, False])
def test_sample_keys_are_generates_splits_with_one_program(impl, partitionable):
    """Sample `j` of `num_samples=n` gets `jax.random.split(key, n)[j]`, as `generate` gives
    it, for every `n` up to a shard's slots; under JAX's default partitionable threefry every
    `n` shares one compiled split (the engine's warmup compiled one per `n` before)."""
    from eqrope.serving._settings import sample_keys

    key = jax.random.key(5, impl=impl)
    with jax.threefry_partitionable(partitionable):
        want = {n: np.asarray(jax.random.key_data(jax.random.split(key, n))) for n in range(2, 9)}
        sample_keys(key, 2, 8)
        with counting() as c:
            got = {n: np.stack(sample_keys(key, n, 8)) for n in range(2, 9)}
        one = sample_keys(key, None, 8)
    for n in want:
        np.testing.assert_array_equal(got[n], want[n])
    np.testing.assert_array_equal(one[0], np.asarray(jax.random.key_data(key)))
    if partitionable and impl == "threefry2x32":
        assert sum(c.compiles.values()) == 0, dict(c.compiles)
