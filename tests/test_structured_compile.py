"""Structured output, the compile half (issue 41): `eqrope.Regex`, `Choice` and `JsonSchema`
compiled against a byte-level BPE tokenizer into an `Automaton`, against independent
references:

- outlines-core's own `Index` (`get_allowed_tokens`, `get_next_state`, `is_final_state`)
  at every state, on a vocabulary read from llguidance's `decode_bytes`;
- llguidance's mask (compact whitespace) on the same prefixes of random paths, except the
  documented differences, each shown by its own test;
- Python's `json.loads` and `jsonschema` for the text of random paths, and `re.fullmatch`
  for regexes; every string of a `Choice`, enumerated.
"""

import json
import random
import re
import subprocess
import sys

import numpy as np
import pytest

import eqrope


oc = pytest.importorskip("outlines_core")
llguidance = pytest.importorskip("llguidance")
lnp = pytest.importorskip("llguidance.numpy")
jsonschema = pytest.importorskip("jsonschema")

from eqrope.structured._export import export  # noqa: E402

# The fixtures `raw`, `tok` and `lltok` (module-scoped) come from _structured.py.
from _structured import EOS, NESTED, Outlines, allowed, distances, lltok, raw, spelled_by_llguidance, step, tok, walk  # noqa: E402, F401


@pytest.fixture(scope="module")
def spelled(raw, lltok) -> list[bytes]:
    """Each token's bytes as llguidance reads them (`b""` for special tokens)."""
    return spelled_by_llguidance(raw, lltok)


# --- the specs ----------------------------------------------------------------------------

FLAT = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer"},
        "ok": {"type": "boolean"},
        "naïve": {"type": "null"},
    },
    "required": ["name", "age", "ok", "naïve"],
    "additionalProperties": False,
}
TREE = {
    "$defs": {
        "node": {
            "type": "object",
            "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
            "required": ["v"],
            "additionalProperties": False,
        }
    },
    "$ref": "#/$defs/node",
}
FORMATS = {
    "type": "object",
    "properties": {f: {"type": "string", "format": f} for f in ("date", "time", "date-time", "uuid")},
    "required": ["date", "time", "date-time", "uuid"],
    "additionalProperties": False,
}
SCHEMAS = [
    FLAT,
    NESTED,
    TREE,
    FORMATS,
    {"enum": ["red", "green", 3, None, True, 2.5]},
    {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}, {"type": "null"}]},
    {"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 2}, {"type": "boolean"}]},
    {"type": "string", "pattern": "^[a-z]{2,4}-[0-9]+$", "title": "code"},
    {"type": "object"},
    {"type": "array", "items": {"type": "object", "properties": {"k": {"const": "v"}, "n": {"type": "number"}}, "required": ["k", "n"]}, "minItems": 1, "maxItems": 2},
]
REGEXES = [r"[0-9]{4}-[0-9]{2}-[0-9]{2}", r"(the|The) (cat|dog) sat", r"[a-c]+x?"]


# --- against outlines-core's Index ---------------------------------------------------------


@pytest.mark.parametrize(
    "spec",
    [eqrope.Regex(REGEXES[0]), eqrope.Regex(REGEXES[1]), eqrope.Choice(["yes", "no", "a.b", "日本"]),
     eqrope.JsonSchema(FLAT), eqrope.JsonSchema(NESTED), eqrope.JsonSchema(TREE),
     eqrope.JsonSchema(FLAT, whitespace="flexible"), eqrope.JsonSchema({"type": "object"})],
    ids=lambda s: type(s).__name__,
)  # fmt: skip
def test_every_state_agrees_with_outlines_index(tok, spelled, spec):
    """outlines-core's index of the regex followed by the END marker U+10FFFF (which a
    pseudo-token spells): a state accepts where END leads to a final state."""
    outlines = Outlines(oc, spec.regex(), spelled)
    index = outlines.index
    a, states = export(index, len(spelled), end_id=outlines.end, eos_id=EOS)
    assert states[0] == index.get_initial_state()
    # The public path (END and EOS ids past the vocabulary) builds the same table.
    public = spec.compile(tok)
    for ours, theirs in zip(public[:-1], a[:-1]):
        np.testing.assert_array_equal(ours, theirs)
    # Only tokens to outlines' states from which an END can be reached (`Outlines.allowed`).
    for k, state in enumerate(states.tolist()):
        theirs = outlines.allowed(state) - {EOS}
        assert allowed(a, k) == theirs, k
        for t in theirs:
            assert states[step(a, k, t)] == index.get_next_state(state, t)
        assert a.accepting[k] == outlines.accepting(state)
        assert a.accepting[k] or theirs


def test_the_table_covers_the_models_vocabulary(tok):
    a = eqrope.Regex("[a-z]+").compile(tok, vocab=1000)
    b = eqrope.Regex("[a-z]+").compile(tok)
    size = len(tok.token_bytes())
    assert a.vocab == 1000 and a.allowed.shape[1] == 32 and b.allowed.shape[1] == -(-size // 32)
    assert all(max(allowed(a, s)) < size for s in range(a.accepting.size))
    np.testing.assert_array_equal(a.allowed[:, : b.allowed.shape[1]], b.allowed)
    assert eqrope.Regex("[a-z]+").compile(tok, vocab=np.int64(1000)) is a
    with pytest.raises(ValueError, match=r"vocab \(the model's vocabulary size, at least the tokenizer's"):
        eqrope.Regex("[a-z]+").compile(tok, vocab=size - 1)


def test_compiled_automata_are_cached_and_read_only(tok):
    a = eqrope.JsonSchema(FLAT).compile(tok)
    assert eqrope.JsonSchema(dict(FLAT)).compile(tok) is a
    assert eqrope.JsonSchema(FLAT, whitespace="flexible").compile(tok) is not a
    with pytest.raises(ValueError):
        a.allowed[0, 0] = 0


# --- the text of random paths -------------------------------------------------------------


@pytest.mark.parametrize("schema", SCHEMAS, ids=range(len(SCHEMAS)))
@pytest.mark.parametrize("whitespace", ["compact", "flexible"])
def test_random_paths_are_valid_json(tok, schema, whitespace):
    a = eqrope.JsonSchema(schema, whitespace=whitespace).compile(tok)
    dist, rng, spelled = distances(a), random.Random(0), tok.token_bytes()
    for _ in range(40):
        path = walk(a, rng, dist)
        assert path is not None
        text = b"".join(spelled[t] for t in path).decode()
        value = json.loads(text)
        jsonschema.validate(value, schema)
        if whitespace == "compact":
            assert text == json.dumps(value, ensure_ascii=False, separators=(",", ":")) or "e" in text.lower()
        if schema is FORMATS:  # stricter than jsonschema's format checks, which need extras
            assert re.fullmatch(r"\d{4}-\d\d-\d\d", value["date"], re.ASCII)
            assert re.fullmatch(r"\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)?", value["time"], re.ASCII)
            assert re.fullmatch(r"[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", value["uuid"])


@pytest.mark.parametrize("pattern", REGEXES)
def test_random_paths_match_the_regex(tok, pattern):
    a = eqrope.Regex(pattern).compile(tok)
    rng, spelled = random.Random(1), tok.token_bytes()
    for _ in range(40):
        path = walk(a, rng, distances(a))
        assert re.fullmatch(pattern, b"".join(spelled[t] for t in path).decode())


@pytest.mark.parametrize(
    "pattern, texts, not_texts",
    [("^[a-z]{2}$", ["ab"], ["abc"]), ("a|bc", ["a", "bc"], ["abc"]), ("^a|bc$", ["a", "bc"], ["ac"]),
     ("x\\$", ["x$"], ["x"]), ("[0-9]+", ["12"], ["1a"])],
)  # fmt: skip
def test_a_pattern_matches_the_whole_string(tok, pattern, texts, not_texts):
    """Anchored or not, a `pattern` must match the whole string (a subset of JSON Schema's
    search semantics); `a|b` stays inside the quotes."""
    schema = {"type": "string", "pattern": pattern}
    a, spelled = eqrope.JsonSchema(schema).compile(tok), tok.token_bytes()
    by_text = {spelled[t]: t for t in range(len(spelled)) if spelled[t]}

    def accepts(text: str) -> bool:
        s = 0
        for b in json.dumps(text).encode():
            t = by_text[bytes([b])]
            if t not in allowed(a, s):
                return False
            s = step(a, s, t)
        return bool(a.accepting[s])

    assert all(accepts(t) for t in texts) and not any(accepts(t) for t in not_texts)


def test_a_choice_writes_exactly_its_strings(tok):
    choices = ["", "yes", "no", "nothing", "a.b", "(x)|y*", 'say "hi"\n', "日本", "maybe", "maybe so"]
    a = eqrope.Choice(choices).compile(tok)
    spelled, found = tok.token_bytes(), set()

    def every(s: int, text: bytes):
        if a.accepting[s]:
            found.add(text.decode())
        for t in allowed(a, s):
            every(step(a, s, t), text + spelled[t])

    every(0, b"")
    assert found == set(choices)


# --- refusals ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "schema, words",
    [
        ({"type": "integer", "minimum": 3}, ["'minimum'", "/minimum"]),
        ({"not": {"type": "null"}}, ["'not'", "/not"]),
        ({"type": "object", "patternProperties": {"a": {}}}, ["'patternProperties'"]),
        ({"type": "object", "properties": {"e": {"type": "string", "format": "email"}}}, ["'email'", "/properties/e/format"]),
        ({"allOf": [{"type": "integer"}]}, ["'allOf'"]),
        ({"type": "array", "prefixItems": [{"type": "integer"}]}, ["'prefixItems'"]),
        ({"type": "string", "pattern": "^.+$"}, ["pattern", "escape"]),
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, ["'oneOf'", "anyOf"]),
        ({"type": "object", "properties": {"a": {}}, "additionalProperties": True}, ["'additionalProperties'"]),
        ({"type": "string", "maxLength": 3, "pattern": "a"}, ["maxLength", "pattern"]),
        ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, ["'required'"]),
        ({"enum": [[1]]}, ["'enum'", "/enum/0"]),
        ({"enum": [1], "type": 5}, ["'type' must be one of", "/type"]),
        ({"enum": [True], "type": "integer"}, ["not of the schema's type", "/enum/0"]),
        ({"type": "object", "properties": {'a"b': {}}}, ["needs escaping"]),
        ({"$ref": "https://example.com/s.json"}, ["local references"]),
        ({"type": "integer", "maxLength": 3}, ["'maxLength'", "does not apply"]),
    ],
)
def test_refused_keywords_are_named(tok, schema, words):
    with pytest.raises(ValueError) as e:
        eqrope.JsonSchema(schema).compile(tok)
    for word in words:
        assert word in str(e.value)


def test_outlines_alone_would_ignore_minimum(tok):
    """Why the allow-list: outlines-core builds a regex that ignores `minimum`."""
    from outlines_core.json_schema import build_regex_from_schema

    assert re.fullmatch(build_regex_from_schema(json.dumps({"type": "integer", "minimum": 3})), "0")


def test_the_state_budget_names_its_argument(tok):
    with pytest.raises(ValueError, match="max_states=20"):
        eqrope.JsonSchema({"type": "string", "maxLength": 40}, max_states=20).compile(tok)
    assert eqrope.JsonSchema({"type": "string", "maxLength": 40}).compile(tok).accepting.size > 20
    with pytest.raises(ValueError, match=r"max_states \(default 4096\) must be a positive int"):
        eqrope.Regex("a", max_states=0)


def _tiny():
    import tokenizers
    from tokenizers import decoders, models

    words = tokenizers.Tokenizer(models.BPE({"a": 0, "b": 1, "aa": 2}, [("a", "a")]))
    words.decoder = decoders.ByteLevel()
    tok = eqrope.Tokenizer(words)
    assert tok.token_bytes() == [b"a", b"b", b"aa"]
    return tok


def test_a_choice_is_not_hidden_by_a_shorter_one():
    """outlines-core's index of `(?:)|(?:a)` alone never writes `a` (its start state
    matches already); with the END marker it does."""
    a = eqrope.Choice(["", "a"]).compile(_tiny())
    assert a.accepting[0] and allowed(a, 0) == {0} and a.accepting[step(a, 0, 0)]


def test_dead_ends_are_pruned_and_an_empty_language_refused():
    """With the tokens `a`, `b`, `aa` only, `a*c|b` can write `b` alone: outlines-core keeps
    the state after `a` (it loops on `a` and never accepts); the export drops it."""
    tok = _tiny()
    a = eqrope.Regex("a*c|b").compile(tok)
    assert allowed(a, 0) == {1} and a.accepting.tolist() == [False, True]
    with pytest.raises(ValueError, match="accepts no text this tokenizer can write"):
        eqrope.Regex("a*c").compile(tok)


def test_the_extra_is_named_without_outlines_core(tok, monkeypatch):
    monkeypatch.setitem(sys.modules, "outlines_core", None)
    from eqrope.structured import _compile

    _compile._byte_vocabulary.cache_clear()
    with pytest.raises(ImportError, match=re.escape('pip install "eqrope[structured]"')):
        eqrope.Regex("never compiled before [0-9]").compile(tok)
    _compile._byte_vocabulary.cache_clear()


def test_importing_eqrope_does_not_import_outlines_core():
    code = "import sys, eqrope; assert 'outlines_core' not in sys.modules and 'llguidance' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
