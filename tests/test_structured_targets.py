"""Structured output, issue 41's correctness targets at a small vocabulary (a byte-level BPE
of <= 400 tokens, a random model, temperature 1.5):

- 1,000 sampled completions across 10 JSON schemas all end with EOS, parse with
  `json.loads` and validate with `jsonschema`; 300 across 3 regexes (an ISO date among
  them) all `re.fullmatch`;
- at every step of those runs, the traced allowed set (the jitted `constrain_logits`
  the decode loop calls, at the state the loop's `advance` gives) equals outlines-core's
  allowed tokens at the state reached by walking its own `Index` beside the tokens;
- 20 different specs within one capacity compile no new XLA program.

The text is read with llguidance's bytes of each token, not eqrope's.
"""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _compiles import counting
from _models import random_model

import eqrope
from eqrope.generation._constraint import advance, constrain_logits
from eqrope.generation._constraint_table import constraint_of
from eqrope.generation._request import sampling_of


oc = pytest.importorskip("outlines_core")
llguidance = pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from _structured import EOS, Outlines, bpe_tokenizer, spelled_by_llguidance  # noqa: E402


SAMPLES, MAX_NEW, PROMPT, TEMPERATURE = 100, 160, 4, 1.5
_STR = {"type": "string", "maxLength": 6}
SCHEMAS = {
    "flat_record": {
        "type": "object",
        "properties": {"name": _STR, "age": {"type": "integer"}, "ok": {"type": "boolean"}, "score": {"type": "number"}},
        "required": ["name", "age", "ok", "score"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer"}, "name": _STR},
                "required": ["id", "name"],
                "additionalProperties": False,
            },
            "status": {"enum": ["open", "closed"]},
        },
        "required": ["user", "status"],
        "additionalProperties": False,
    },
    "enums": {"enum": ["red", "green", "blue", 3, None, True, 2.5]},
    "bounded_array": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
    "numbers": {
        "type": "object",
        "properties": {"x": {"type": "number"}, "n": {"type": "integer"}},
        "required": ["x", "n"],
        "additionalProperties": False,
    },
    "optional_props": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}, "c": {"const": "z"}},
        "required": ["b"],
        "additionalProperties": False,
    },
    "max_length_strings": {
        "type": "object",
        "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 5}, "t": {"type": "string", "maxLength": 3}},
        "required": ["s", "t"],
        "additionalProperties": False,
    },
    "booleans": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
    "any_of": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 4}, {"type": "null"}]},
    "formats": {
        "type": "object",
        "properties": {
            "day": {"type": "string", "format": "date"},
            "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
            "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2},
        },
        "required": ["day", "code", "tags"],
        "additionalProperties": False,
    },
}
REGEXES = {
    "iso_date": r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    "sentence": r"(the|The) (cat|dog) sat( on the (mat|log))?",
    "word_list": r"[a-z]{1,6}(, [a-z]{1,6}){0,3}",
}
SPECS = {**{k: eqrope.JsonSchema(s) for k, s in SCHEMAS.items()}, **{k: eqrope.Regex(r) for k, r in REGEXES.items()}}


@pytest.fixture(scope="module")
def setup():
    raw = bpe_tokenizer()
    vocab = raw.get_vocab_size()
    tok = eqrope.Tokenizer(raw, eos_ids=[EOS])
    spelled = spelled_by_llguidance(raw, llguidance.LLTokenizer(raw.to_str(), eos_token=EOS))
    model = random_model(0, vocab, 32, 4, 1, PROMPT + MAX_NEW, n_kv_heads=2, d_ff=64)
    return model, tok, spelled, vocab


@pytest.fixture(scope="module")
def run(setup):
    """One `generate` call: a prompt per spec, `SAMPLES` samples each."""
    model, tok, _, vocab = setup
    automata = [spec.compile(tok, vocab=vocab) for spec in SPECS.values()]
    prompts = np.random.default_rng(0).integers(3, vocab, size=(len(SPECS), PROMPT)).astype(np.int32)
    out = eqrope.generate(
        model, prompts, MAX_NEW, eos_id=EOS, temperature=TEMPERATURE, key=jax.random.key(0),
        num_samples=SAMPLES, constraint=automata, return_logprobs=True,  # for the lengths
    )  # fmt: skip
    constraint = constraint_of(automata, None, None, batch=len(SPECS), batched=True, samples=SAMPLES, vocab=vocab)
    return np.asarray(out.tokens), np.asarray(out.lengths), constraint


def _texts(setup, run, name: str) -> list[str]:
    _, _, spelled, _ = setup
    tokens, lengths, _ = run
    row = list(SPECS).index(name)
    texts = []
    for j in range(SAMPLES):
        new = tokens[row, j, PROMPT : lengths[row, j]].tolist()
        assert new and new[-1] == EOS, (name, j, new)  # ended, within MAX_NEW
        texts.append(b"".join(spelled[t] for t in new[:-1]).decode())
    return texts


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_completion_is_valid_json(setup, run, name):
    texts = _texts(setup, run, name)
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMAS[name])
    assert len(set(texts)) > 1  # sampled, not one text


@pytest.mark.parametrize("name", list(REGEXES))
def test_every_completion_matches_the_regex(setup, run, name):
    texts = _texts(setup, run, name)
    assert all(re.fullmatch(REGEXES[name], t) for t in texts), texts
    assert len(set(texts)) > 1


@jax.jit
def _states(table, start, new_tokens, n_new):
    """Each row's state before each new token, by the loop's own `advance`."""

    def one(states, step):
        tokens, i = step
        return advance(table, states, tokens, i < n_new), states

    _, before = jax.lax.scan(one, start, (new_tokens.T, jnp.arange(new_tokens.shape[1], dtype=jnp.int32)))
    return before.T


@jax.jit
def _masks(table, states, sampling):
    """The loop's mask (`constrain_logits`) at each state: the ids left finite."""
    logits = jnp.zeros((states.shape[0], jnp.shape(table.allowed)[1] * 32), jnp.float32)
    n_new = jnp.full(states.shape, 1 << 20, jnp.int32)
    masked, stuck = constrain_logits(table, states, logits, n_new, sampling)
    return jnp.isfinite(masked), stuck


def test_the_traced_mask_equals_outlines_at_every_step(setup, run):
    _, _, spelled, vocab = setup
    tokens, lengths, constraint = run
    rows = tokens.reshape(-1, tokens.shape[-1])
    n_new = (lengths.reshape(-1) - PROMPT).astype(np.int32)
    ours = np.asarray(_states(constraint.table, jnp.asarray(constraint.start), jnp.asarray(rows[:, PROMPT:], jnp.int32), jnp.asarray(n_new)))
    pairs, steps = set(), 0  # (spec, outlines' state, our state) met at some step
    for k, spec in enumerate(SPECS.values()):
        outlines = Outlines(oc, spec.regex(), spelled)
        for j in range(SAMPLES):
            r, state = k * SAMPLES + j, outlines.initial
            for i, t in enumerate(rows[r, PROMPT : lengths.reshape(-1)[r]].tolist()):
                pairs.add((k, state, int(ours[r, i])))
                steps += 1
                assert t in outlines.allowed(state), (k, j, i, t)
                if t != EOS:
                    state = outlines.next(state, t)
    pairs = sorted(pairs)
    sampling, _ = sampling_of(eqrope.GenerationConfig(eos_id=EOS, temperature=TEMPERATURE), vocab)
    ids = np.array([p[2] for p in pairs], np.int32)
    masks, stuck = _masks(constraint.table, jnp.asarray(ids), sampling)
    masks = np.asarray(masks)[:, :vocab]
    assert not np.any(np.asarray(stuck))
    by_spec = {k: Outlines(oc, spec.regex(), spelled) for k, spec in enumerate(SPECS.values())}
    for (k, state, _), mask in zip(pairs, masks):
        expected = by_spec[k].mask(state, vocab)
        assert np.array_equal(mask, expected), (list(SPECS)[k], state, np.flatnonzero(mask != expected))
    assert steps == int(n_new.sum()) > 30_000 and len(pairs) > 400


def test_twenty_specs_within_the_capacity_compile_nothing(setup):
    model, tok, _, vocab = setup
    more = [eqrope.Choice(["yes", "no", "maybe"]), eqrope.Choice(["a", "ab", "abc"]), eqrope.Regex("[0-9]{2,3}"),
            eqrope.Regex("(red|blue)-[a-z]{2}"), eqrope.JsonSchema({"type": "integer"}),
            eqrope.JsonSchema({"type": "array", "items": {"type": "null"}, "maxItems": 2}),
            eqrope.JsonSchema(SCHEMAS["flat_record"], whitespace="flexible")]  # fmt: skip
    automata = [spec.compile(tok, vocab=vocab) for spec in [*SPECS.values(), *more]]
    assert len(automata) == 20 and len({id(a) for a in automata}) == 20
    pairs = [[automata[i], automata[(i + 1) % 20]] for i in range(20)]
    states = max(1 + sum(a.accepting.size for a in p) for p in pairs)
    exceptions = max(sum(a.exc_token.size for a in p) for p in pairs)
    capacity = (states, exceptions)
    prompts = np.random.default_rng(1).integers(3, vocab, size=(2, PROMPT)).astype(np.int32)
    kwargs = dict(eos_id=EOS, temperature=TEMPERATURE, constraint_capacity=capacity)
    eqrope.generate(model, prompts, 8, constraint=pairs[-1], key=jax.random.key(99), **kwargs)  # compiles once
    with counting() as c:
        for i, pair in enumerate(pairs):
            out = eqrope.generate(model, prompts, 8, constraint=pair, key=jax.random.key(i), **kwargs)
            assert np.asarray(out).shape == (2, PROMPT + 8)
    assert sum(c.compiles.values()) == 0 and c.traces["generate_program"] == 0, (c.compiles, c.traces)
