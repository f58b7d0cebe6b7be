"""Structured output in the engine (issue 41 item 3): per-request automata in one batch,
opt-in with `Engine(constraint_capacity=)`.

Each request is compared with `eqrope.generate(..., constraint=)` of it alone with the same
key (the free ones with `generate` without a constraint, bitwise), and its text with
Python's `re.fullmatch` or `json.loads` and `jsonschema`, on the byte-level BPE checkpoint
of `tests/_serve.py`. The table is small enough that the three automata cannot all be in it
at once: requests wait for a block, and blocks are freed and reused.
"""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqrope
from eqrope import GenerationConfig as Config

from _compiles import counting
from eqrope.generation._constraint import advance
from eqrope.generation._constraint_table import merge
from eqrope.serving._constraints import ConstraintBlocks
from test_stop_strings import checkpoint, model, tok  # noqa: F401 (the checkpoint of tests/_serve.py)

pytest.importorskip("outlines_core")  # the [structured] extra
jsonschema = pytest.importorskip("jsonschema")  # [structured]: the independent validator

NEW = 40
ENGINE = {"slots": 4, "decode_buckets": (4,), "max_len": 128, "page_size": 16, "prefill_chunk": 32, "decode_steps": 8}
REGEX = r"[0-9]{2,4}-[a-z]{1,3}"
CHOICES = ["yes", "no", "maybe so"]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
}
# Room for the schema's automaton with one of the others, not for all three at once.
CAPACITY = (96, 1024)


@pytest.fixture(scope="module")
def automata(model, tok):
    specs = {"regex": eqrope.Regex(REGEX), "choice": eqrope.Choice(CHOICES), "json": eqrope.JsonSchema(SCHEMA)}
    return {name: spec.compile(tok, vocab=model.config.vocab_size) for name, spec in specs.items()}


@pytest.fixture(scope="module")
def engine(model):
    return eqrope.Engine(model, constraint_capacity=CAPACITY, **ENGINE)


@pytest.fixture(scope="module")
def plain(model):
    """The same engine without constraints: its programs are those of an engine before them."""
    return eqrope.Engine(model, **ENGINE)


def _alone(model, tok, ids, key, constraint, **settings):
    out = eqrope.generate(
        model, ids, NEW, eos_id=list(tok.eos_ids), key=key, constraint=constraint, return_logprobs=True,
        constraint_capacity=(128, 1024), **settings,  # one program for every automaton
    )  # fmt: skip
    end = int(out.lengths)
    return np.asarray(out.tokens)[len(ids) : end].tolist(), np.asarray(out.logprobs)[len(ids) : end]


def _valid(tok, kind: str, tokens: list[int]) -> bool:
    text = tok.decode([t for t in tokens if t not in tok.eos_ids])
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    jsonschema.validate(json.loads(text), SCHEMA)
    return True


def test_mixed_requests_match_generate_alone(engine, plain, model, tok, automata):
    prompts = [np.asarray(tok.encode(t), np.int32) for t in ("The cat sat", "JSON: {", "One, two", "Answer:")]
    # The free requests first: they prefill in the same call and hold the same slots in
    # both engines, so their arithmetic is the same, and must give the same bits.
    kinds = [None, None, "json", "regex", "choice", "json", "choice", "regex", "json", "regex"]
    temperatures = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.5, 0.0]
    ids = [prompts[i % len(prompts)] for i in range(len(kinds))]
    keys = [jax.random.key(100 + i) for i in range(len(kinds))]
    configs = [Config(max_new=NEW, eos_id=list(tok.eos_ids), temperature=t) for t in temperatures]
    constraints = [None if k is None else automata[k] for k in kinds]
    out = engine.generate(ids, configs, keys=keys, constraints=constraints)
    unconstrained = plain.generate(ids, configs, keys=keys)
    for i in (0, 1):  # bitwise those of an engine without constraints
        np.testing.assert_array_equal(out[i].tokens, unconstrained[i].tokens)
        np.testing.assert_array_equal(out[i].logprobs, unconstrained[i].logprobs)
    for kind, prompt, key, t, constraint, completion in zip(kinds, ids, keys, temperatures, constraints, out):
        if kind is None:  # the plain engine's, which tests/test_engine.py holds to generate's
            continue
        tokens, logprobs = _alone(model, tok, prompt, key, constraint, temperature=t)
        assert completion.tokens.tolist() == tokens, kind
        np.testing.assert_allclose(completion.logprobs, logprobs, rtol=1e-5, atol=1e-5)
        assert completion.finish_reason == "eos", (kind, tok.decode(tokens))
        assert _valid(tok, kind, tokens), tok.decode(tokens)
    # Every block was freed with its last request: the table holds FREE alone again.
    assert not engine.constraints.blocks and not engine.constraints.held
    assert np.all(np.asarray(engine.constraints.host.exc_token) == np.iinfo(np.int32).max)


def test_new_schemas_compile_nothing(engine, model, tok):
    schemas = [
        {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"]},
        {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        {"enum": ["red", "green", "blue"]},
    ]
    specs = [eqrope.JsonSchema(s) for s in schemas] + [eqrope.Regex(r"[a-c]{3}"), eqrope.Choice(["up", "down"])]
    automata = [s.compile(tok, vocab=model.config.vocab_size) for s in specs]
    prompt = np.asarray(tok.encode("The dog"), np.int32)
    config = Config(max_new=24, eos_id=list(tok.eos_ids), temperature=1.0)
    engine.generate([prompt], [config], constraints=[automata[0]])  # the start's program at this prompt length
    with counting() as compiles:
        out = engine.generate([prompt] * len(automata), config, constraints=automata)
    assert sum(compiles.compiles.values()) == 0, compiles.compiles
    texts = [tok.decode([t for t in c.tokens.tolist() if t not in tok.eos_ids]) for c in out]
    for schema, text in zip(schemas, texts):
        jsonschema.validate(json.loads(text), schema)
    assert re.fullmatch(r"[a-c]{3}", texts[3]) and texts[4] in ("up", "down")


def test_think_end_starts_the_constraint_after_it(engine, plain, model, tok, automata):
    """`submit(..., think_end=)` against `generate(..., think_end=)` alone; greedy, the
    text before the end-of-thinking id is the free text, and the rest matches."""
    prompt = np.asarray(tok.encode("One, two"), np.int32)
    free = plain.generate([prompt], Config(max_new=NEW, temperature=0.0))[0].tokens.tolist()
    think = [free[3]]
    ends = {}
    for i, t in enumerate((0.0, 1.0)):
        config = Config(max_new=NEW, eos_id=list(tok.eos_ids), temperature=t)
        ends[engine.submit(prompt, config, key=jax.random.key(i), constraint=automata["regex"], think_end=think)] = i
    tokens = {i: [] for i in ends.values()}
    while engine.has_work():
        for event in engine.step():
            tokens[ends[event.request_id]] += event.tokens.tolist()
    for i, t in enumerate((0.0, 1.0)):
        alone, _ = _alone(model, tok, prompt, jax.random.key(i), automata["regex"], temperature=t, think_end=think)
        assert tokens[i] == alone
    greedy = tokens[0]
    assert greedy[:4] == free[: free.index(think[0]) + 1]
    assert re.fullmatch(REGEX, tok.decode(greedy[4:-1])) and greedy[-1] in tok.eos_ids
    with pytest.raises(ValueError, match="think_end applies to a constrained request"):
        engine.submit(prompt, max_new=4, think_end=think)
    assert not engine.constraints.held


def test_refusals_name_the_argument(engine, plain, model, tok, automata):
    prompt = np.asarray(tok.encode("The cat"), np.int32)
    with pytest.raises(ValueError, match=r"constraint_capacity=\(states, exceptions\)"):
        plain.submit(prompt, max_new=4, constraint=automata["regex"])
    with pytest.raises(ValueError, match=r"constraint needs 82 states .* constraint_capacity=\(16, 1024\).*=\(82, 1024\) or more"):
        small = eqrope.Engine(model, constraint_capacity=(16, 1024), **ENGINE)
        small.submit(prompt, max_new=4, constraint=automata["json"])
    with pytest.raises(TypeError, match="constraint must be an eqrope Automaton.*compile"):
        engine.submit(prompt, max_new=4, constraint=eqrope.Regex("a+"))
    wide = eqrope.Regex("a+").compile(tok, vocab=model.config.vocab_size + 32)
    with pytest.raises(ValueError, match=r"constraint covers 352 token ids.*vocab=320"):
        engine.submit(prompt, max_new=4, constraint=wide)
    assert not engine.has_work()


@jax.jit
def _next_states(table):
    """`advance` from every state of `table` after every token: `(states, vocab)`."""
    states, vocab = table.allowed.shape[0], table.allowed.shape[1] * 32
    tokens = jnp.arange(vocab, dtype=jnp.int32)
    each = lambda s: advance(table, jnp.full((vocab,), s), tokens, jnp.ones((vocab,), bool))
    return jax.vmap(each)(jnp.arange(states, dtype=jnp.int32))


def _same_as_alone(blocks, automaton, request):
    """The request's block against `generate`'s own merged table of its automaton alone:
    every state's allowed tokens, acceptance and next state after each allowed token."""
    vocab, n, first = automaton.vocab, len(automaton.default_next), blocks.start(request)
    alone, _ = merge([automaton], None, vocab, (128, 1024))
    ours = np.asarray(_next_states(blocks.device()))[first : first + n, :vocab]
    theirs = np.asarray(_next_states(jax.tree.map(jnp.asarray, alone)))[1 : 1 + n, :vocab]
    allowed = np.asarray(blocks.host.allowed[first : first + n])
    np.testing.assert_array_equal(allowed, alone.allowed[1 : 1 + n])
    np.testing.assert_array_equal(blocks.host.accepting[first : first + n], alone.accepting[1 : 1 + n])
    bits = np.unpackbits(allowed.view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(bool)
    np.testing.assert_array_equal(np.where(bits, ours - first, -1), np.where(bits, theirs - 1, -1))


def test_blocks_wait_free_and_reuse(model, automata):
    blocks = ConstraintBlocks(CAPACITY, model.config.vocab_size)
    assert blocks.hold(0, automata["json"]) and blocks.hold(1, automata["regex"])
    assert blocks.hold(2, automata["json"])  # shared, counted
    assert not blocks.hold(3, automata["choice"])  # no room: the request waits
    blocks.release(1)
    assert blocks.hold(3, automata["choice"])  # in the regex's gap
    _same_as_alone(blocks, automata["json"], 2)
    _same_as_alone(blocks, automata["choice"], 3)
    blocks.release(0)
    assert not blocks.hold(4, automata["regex"])  # the json's block is still held by request 2
    blocks.release(2)
    assert blocks.hold(4, automata["regex"])  # first fit: where the json's was, before the choice
    assert blocks.start(4) == 1 < blocks.start(3)
    _same_as_alone(blocks, automata["choice"], 3)
    _same_as_alone(blocks, automata["regex"], 4)
