"""Structured output against llguidance (issue 41): with compact whitespace, eqrope's
allowed sets equal llguidance's mask on the same prefixes of random paths, except the
documented differences (docs/structured.md), each shown by its own test here. The
tokenizer is tests/_structured.py's byte-level BPE.
"""

import random

import numpy as np
import pytest

import eqrope


oc = pytest.importorskip("outlines_core")
llguidance = pytest.importorskip("llguidance")
lnp = pytest.importorskip("llguidance.numpy")

# The fixtures `raw`, `tok` and `lltok` (module-scoped) come from _structured.py.
from _structured import EOS, NESTED, allowed, distances, lltok, raw, step, tok  # noqa: E402, F401


# --- against llguidance (compact whitespace) ------------------------------------------------


def masks(lltok, schema) -> tuple:
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    matcher = llguidance.LLMatcher(lltok, grammar)
    assert not matcher.is_error(), matcher.get_error()
    bitmask = lnp.allocate_token_bitmask(1, lltok.vocab_size)

    def mask() -> set[int]:
        lnp.fill_next_token_bitmask(matcher, bitmask, 0)
        bits = np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")
        return set(np.flatnonzero(bits).tolist()) - {EOS}

    return matcher, mask


COMPARED = [
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}, "c": {"enum": ["x", "yy", 3]}}, "required": ["a", "b"], "additionalProperties": False},
    {"type": "array", "items": {"anyOf": [{"type": "integer"}, {"type": "null"}]}, "minItems": 1, "maxItems": 3},
    {
        "type": "object",
        "properties": {"s": {"type": "string", "pattern": "^[a-z ]{1,5}$"}, "t": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 2}},
        "required": ["s"],
        "additionalProperties": False,
    },
    # A string with length bounds holds no escapes here: see test_difference_string_escapes.
    {**NESTED, "properties": {**NESTED["properties"], "note": {"type": "string", "pattern": "^[a-z]{0,3}$"}}},
]


@pytest.mark.parametrize("schema", COMPARED, ids=range(len(COMPARED)))
def test_masks_equal_llguidance_on_random_prefixes(tok, lltok, schema):
    """Equal, except where llguidance forces the next bytes: then it allows only the
    tokens of their canonical split (`{"` for `{"a":`), and we allow any token that
    spells a prefix of them (`{` too): see the next test."""
    a = eqrope.JsonSchema(schema).compile(tok)
    rng, spelled, dist = random.Random(2), tok.token_bytes(), distances(a)
    compared = 0
    for _ in range(30):
        matcher, mask = masks(lltok, schema)
        s = 0
        while True:
            ours, theirs, forced = allowed(a, s), mask(), matcher.compute_ff_bytes()
            assert theirs <= ours
            assert all(forced.startswith(spelled[t]) for t in ours - theirs), (ours - theirs, forced)
            compared += 1
            if a.accepting[s] and (not ours or rng.random() < 0.25):
                assert matcher.is_accepting()
                break
            options = sorted(ours) if rng.random() < 0.5 else [t for t in ours if dist[step(a, s, t)] < dist[s]]
            t = rng.choice(options)
            assert matcher.consume_token(t)
            s = step(a, s, t)
    assert compared > 100


def _after(a, lltok, schema, ids):
    matcher, mask = masks(lltok, schema)
    s = 0
    for t in ids:
        assert t in allowed(a, s)
        assert matcher.consume_token(t)
        s = step(a, s, t)
    return allowed(a, s), mask(), matcher


def test_difference_forced_bytes(tok, raw, lltok):
    """Where the schema forces `{"a":`, llguidance allows only its canonical first token;
    we allow every token that spells a prefix of it, `{` among them."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
    ours, theirs, matcher = _after(eqrope.JsonSchema(schema).compile(tok), lltok, schema, [])
    brace, brace_quote = raw.token_to_id("{"), raw.token_to_id('{"')
    assert matcher.compute_ff_bytes() == b'{"a":'
    assert {brace, brace_quote} <= ours and brace_quote in theirs and brace not in theirs


def test_difference_string_escapes(tok, raw, lltok):
    """After a backslash in a string we allow `\\/` but never `\\u` (no `\\uXXXX` escapes);
    llguidance the other way round. Both are valid JSON. A string with length bounds holds
    no escapes here."""
    schema = {"type": "string"}
    ours, theirs, _ = _after(eqrope.JsonSchema(schema).compile(tok), lltok, schema, raw.encode('"\\').ids)
    slash, u = raw.token_to_id("/"), raw.token_to_id("u")
    assert slash in ours and slash not in theirs
    assert u in theirs and u not in ours
    assert ours - {slash} <= theirs
    bounded = {"type": "string", "maxLength": 5}  # no escapes at all (outlines-core is slow to build them)
    ours, theirs, _ = _after(eqrope.JsonSchema(bounded).compile(tok), lltok, bounded, raw.encode('"').ids)
    backslash = raw.token_to_id("\\")
    assert backslash in theirs and backslash not in ours and ours <= theirs


def test_difference_exponent_sign(tok, raw, lltok):
    """A number's exponent needs its sign here (`1e+5`, as outlines-core writes it);
    llguidance also allows `1e5`."""
    schema = {"type": "object", "properties": {"n": {"type": "number"}}, "required": ["n"], "additionalProperties": False}
    ids = [t for c in '{"n":1e' for t in raw.encode(c).ids]
    ours, theirs, _ = _after(eqrope.JsonSchema(schema).compile(tok), lltok, schema, ids)
    plus, five = raw.token_to_id("+"), raw.token_to_id("5")
    assert plus in ours and plus in theirs and five in theirs and five not in ours


def test_an_accepting_state_may_go_on(tok, raw, lltok):
    """outlines-core 0.2.14 keeps, out of a state where its regex matches, only the tokens
    that lead to another such state: after a top-level `1` no `.`, after `no` no `t` of
    `nothing`. With the END marker no state but the last matches: `.` is allowed, as in
    llguidance."""
    schema = {"type": "number"}
    ours, theirs, _ = _after(eqrope.JsonSchema(schema).compile(tok), lltok, schema, [raw.token_to_id("1")])
    dot = raw.token_to_id(".")
    assert dot in ours and ours == theirs
    plain = oc.Index("1(x5)?", oc.Vocabulary(EOS, {b: [i] for i, b in enumerate(tok.token_bytes()) if b}))
    one = raw.token_to_id("1")
    assert plain.get_allowed_tokens(plain.get_next_state(plain.get_initial_state(), one)) == [EOS]
    a = eqrope.Regex("1(x5)?").compile(tok)
    assert allowed(a, step(a, 0, one)) == {raw.token_to_id("x")} and a.accepting[step(a, 0, one)]
    a = eqrope.Choice(["no", "nothing"]).compile(tok)
    s = 0
    for t in raw.encode("no").ids:
        s = step(a, s, t)
    assert a.accepting[s] and allowed(a, s)


def test_difference_day_of_month(tok, raw, lltok):
    """A `date` allows days 01-31 in every month; llguidance knows each month's length."""
    schema = {"type": "string", "format": "date"}
    ids = [t for c in '"2023-02-' for t in raw.encode(c).ids]
    ours, theirs, _ = _after(eqrope.JsonSchema(schema).compile(tok), lltok, schema, ids)
    three = raw.token_to_id("3")
    assert three in ours and three not in theirs


def test_difference_additional_properties(tok, raw, lltok):
    """Without `additionalProperties: false` llguidance may add properties; we write only
    the listed ones (a subset of the valid texts)."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    ids = [t for c in '{"a":1' for t in raw.encode(c).ids]
    ours, theirs, _ = _after(eqrope.JsonSchema(schema).compile(tok), lltok, schema, ids)
    comma = raw.token_to_id(",")
    assert comma in theirs and comma not in ours
