"""What the cached path compiles and computes: one program per cache length, with the
weights as arguments; one model step per new token in the decode loop (none at the
prefill's shape), and work that follows the tokens generated, not the cache's length.
Counted in the traced program and by a model that records its calls.
"""

import math

import equinox as eqx
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqrope
from _compiles import counting
from _generate_model import MAX_LEN, VOCAB, i32, make_model, random_ids
from _models import random_model
from eqrope.generation import _decode
from eqrope.testing import Uncached


@pytest.fixture(scope="module")
def model():
    return make_model(0)


# -- compiled once ---------------------------------------------------------------------------


def test_generate_compiles_once_per_max_len(capsys):
    # A max_len no other test uses, so the first call must trace.
    model = make_model(3, max_len=20)
    key = jax.random.PRNGKey(0)
    with counting() as c:
        eqrope.generate(model, random_ids(0, 5), 4)
    first = c.traces["generate_program"]
    assert first == 1
    variations = [
        dict(prompt=random_ids(1, 3)),  # prompt length
        dict(prompt=random_ids(2, 11)),
        dict(max_new=1),
        dict(max_new=9),
        dict(max_new=0),
        dict(temperature=0.5, key=key),  # temperature, key None -> value
        dict(temperature=1.7, key=key),
        dict(temperature=0.5, key=jax.random.PRNGKey(9)),  # another key
        dict(temperature=0.5, key=jax.random.key(3)),  # a typed key
        dict(top_k=3),  # top_k None -> value
        dict(top_k=7, temperature=1.0, key=key),
        dict(top_p=0.9),  # top_p None -> value
        dict(top_p=0.5, top_k=2, temperature=1.0, key=key),
        dict(eos_id=3),
        dict(return_logprobs=True),
    ]
    with counting() as c:
        for change in variations:
            kwargs = dict(prompt=random_ids(0, 5), max_new=4)
            kwargs.update(change)
            prompt, max_new = kwargs.pop("prompt"), kwargs.pop("max_new")
            eqrope.generate(model, prompt, max_new, **kwargs)
    after_variations = first + c.traces["generate_program"]
    assert after_variations == 1, f"retraced for one of {variations}"
    with counting() as c:
        eqrope.generate(make_model(4, max_len=22), random_ids(0, 5), 4)  # a new max_len
        after_new_max_len = after_variations + c.traces["generate_program"]
        eqrope.generate(model, random_ids(3, 7), 2)  # back to max_len 20: compiled already
    assert after_new_max_len == 2
    assert c.traces["generate_program"] == 1
    with capsys.disabled():
        print(
            f"\ntrace counts: first call {first}, after {len(variations)} variations "
            f"{after_variations}, after a new max_len {after_new_max_len}"
        )


def test_weights_are_arguments_not_constants(model):
    prompt = random_ids(10, 5)
    before = eqrope.generate(model, prompt, 8)
    with counting() as c:
        # 1. eqx.tree_at: a head bias that makes token 7 win everywhere.
        biased = eqx.tree_at(lambda m: m.head_bias, model, model.head_bias.at[7].add(100.0))
        out = eqrope.generate(biased, prompt, 8)
        np.testing.assert_array_equal(np.asarray(out[5:]), [7] * 8)
        np.testing.assert_array_equal(
            np.asarray(out), np.asarray(eqrope.generate(Uncached(biased), prompt, 8))
        )
        # 2. An optax update that teaches the model to continue with token 11. (Plain SGD:
        # optax.adam's bias correction fails under the suite's strict dtype promotion.)
        optimizer = optax.sgd(0.5)
        train_step = eqrope.make_train_step(optimizer)
        trained, opt_state = model, eqrope.init_optimizer(optimizer, model)
        ids = jnp.concatenate([prompt[None], jnp.full((1, 7), 11, jnp.int32)], axis=1)
        ids = jnp.tile(ids, (2, 1))
        for _ in range(5):
            trained, opt_state, _ = train_step(trained, opt_state, ids[:, :-1], ids[:, 1:])
        out = eqrope.generate(trained, prompt, 8)
        assert not np.array_equal(np.asarray(out), np.asarray(before))
        assert int(jnp.sum(out[5:] == 11)) >= 4
        np.testing.assert_array_equal(
            np.asarray(out), np.asarray(eqrope.generate(Uncached(trained), prompt, 8))
        )
    assert c.traces["generate_program"] == 0  # neither new model retraced


# -- the cached path's work ------------------------------------------------------------------


def sub_jaxprs(eqn):
    for value in eqn.params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, jax.extend.core.ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, jax.extend.core.Jaxpr):
                yield v


def all_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in sub_jaxprs(eqn):
            yield from all_eqns(sub)


def matmul_flops(jaxpr):
    """2 * output size * contracted size, summed over every dot_general (all branches)."""
    total = 0
    for eqn in all_eqns(jaxpr):
        if eqn.primitive.name == "dot_general":
            (lhs_contract, _), _ = eqn.params["dimension_numbers"]
            contracted = math.prod(eqn.invars[0].aval.shape[d] for d in lhs_contract)
            total += 2 * math.prod(eqn.outvars[0].aval.shape) * contracted
    return total


def run_flops(jaxpr):
    """`matmul_flops` of one run: a scan's body counts once per iteration (the stacked
    prefill scans its blocks, the decode step unrolls them), every branch of a cond."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            total += matmul_flops(_one(eqn))
        times = eqn.params["length"] if eqn.primitive.name == "scan" else 1
        total += times * sum(run_flops(sub) for sub in sub_jaxprs(eqn))
    return total


def _one(eqn):
    """A stand-in jaxpr holding `eqn` alone, for `matmul_flops`."""
    return type("One", (), {"eqns": [eqn]})()


def dims(jaxpr):
    return {
        d
        for eqn in all_eqns(jaxpr)
        if eqn.primitive.name == "dot_general"
        for var in eqn.invars
        for d in var.aval.shape
    }


def test_decode_loop_runs_one_token_per_step_not_the_prompt(model):
    """In the jaxpr of the generate program, the decode loop's body does the matmuls of
    exactly one `model.step` per row, and none of the prefill chunk's shape."""
    chunk = 6  # no model dimension is 6
    batch = 1
    buffer = np.zeros((batch, MAX_LEN), np.int32)
    args = (
        model,
        buffer,
        np.array([5], np.int32),
        i32(4),
        eqrope.generation._sampling.Sampling(
            temperature=jnp.asarray(0.0, jnp.float32),
            top_k=i32(VOCAB),
            top_p=jnp.asarray(1.0, jnp.float32),
            eos=i32([-1]),
        ),
        jax.random.key(0),
    )
    program = lambda *a: _decode.generate_cached(*a, batched=True, chunk=chunk)
    closed = eqx.filter_make_jaxpr(program)(*args)[0]
    loops = [e for e in all_eqns(closed.jaxpr) if e.primitive.name == "while"]
    # Two while loops run the model (hold matmuls): the prefill's over the chunks, whose
    # body works on chunks of the prompt, and the decode loop, whose body never does.
    running = [e for e in loops if matmul_flops(e.params["body_jaxpr"].jaxpr) > 0]
    prefill_loop = [e for e in running if chunk in dims(e.params["body_jaxpr"].jaxpr)]
    decode = [e for e in running if chunk not in dims(e.params["body_jaxpr"].jaxpr)]
    assert len(running) == 2 and len(decode) == 1 and len(prefill_loop) == 1
    decode_body = decode[0].params["body_jaxpr"].jaxpr
    prefill_body = prefill_loop[0].params["body_jaxpr"].jaxpr

    # generate decodes on the unstacked layout (per-block weights and cache buffers).
    decoding = model.unstacked()
    one_step = jax.make_jaxpr(jax.vmap(lambda t, c, p: decoding.step(t, c, p, check=False)))(
        i32([1]), decoding.init_cache(batch=batch), i32([5])
    )
    assert matmul_flops(decode_body) == matmul_flops(one_step.jaxpr)

    # The head matmul of the decode body makes one row of logits per sequence, and so
    # does the prefill's: only the row of a prompt's last token goes through the head.
    def head_outputs(jaxpr):
        return [
            e.outvars[0].aval.shape
            for e in all_eqns(jaxpr)
            if e.primitive.name == "dot_general" and e.outvars[0].aval.shape[-1] == VOCAB
        ]

    assert head_outputs(decode_body) and all(
        math.prod(shape) == batch * VOCAB for shape in head_outputs(decode_body)
    )
    assert head_outputs(prefill_body) and all(
        math.prod(shape) == batch * VOCAB for shape in head_outputs(prefill_body)
    )
    assert run_flops(prefill_body) > (chunk - 1) * run_flops(decode_body)


class CountingDecoder(eqx.Module):
    """Delegates the cache protocol to `inner`, and reports each executed step/prefill,
    once per row (under `vmap` a callback sees every row at once)."""

    inner: eqrope.RotaryDecoder

    @property
    def max_len(self):
        return self.inner.max_len

    @property
    def vocab_size(self):
        return self.inner.vocab_size

    def init_cache(self, batch=None, **kwargs):
        CACHE_ROWS.append(kwargs.get("max_len"))  # at trace time: the rows asked for
        return self.inner.init_cache(batch, **kwargs)

    def prefill(self, ids, cache, pos=0, **kwargs):
        record = lambda p, t: EXECUTED.extend([("prefill", int(p))] * np.size(t))  # noqa: E731
        jax.debug.callback(record, pos, ids[0])
        return self.inner.prefill(ids, cache, pos, **kwargs)

    def step(self, token, cache, pos, **kwargs):
        jax.debug.callback(lambda p: EXECUTED.extend(("step", int(q)) for q in np.ravel(p)), pos)
        return self.inner.step(token, cache, pos, **kwargs)


EXECUTED = []
CACHE_ROWS = []


def test_work_follows_the_tokens_generated_not_max_len(capsys):
    inner = random_model(1, VOCAB, 16, 2, 1, 4096, d_ff=32)
    wrapped = CountingDecoder(inner)
    prompt = random_ids(17, 4)
    EXECUTED.clear()
    out = eqrope.generate(wrapped, prompt, 6)
    jax.effects_barrier()
    steps = [p for kind, p in EXECUTED if kind == "step"]
    prefills = [p for kind, p in EXECUTED if kind == "prefill"]
    with capsys.disabled():
        print(f"\nmax_len 4096, 6 new tokens: {len(prefills)} prefill chunk(s), steps at {steps}")
    assert out.shape == (10,)
    assert prefills == [0]  # one chunk holds the whole prompt
    assert len(steps) <= 6 and steps == list(range(4, 4 + len(steps)))
    # And the tokens are right: each is the argmax of a plain forward pass of the text.
    logits = eqx.filter_jit(lambda m, ids: m(ids))(inner, out[:-1])
    np.testing.assert_array_equal(np.asarray(out[4:]), np.asarray(jnp.argmax(logits[3:], axis=-1)))
