"""A JSON schema checked against eqrope's keyword allow-list and rewritten for outlines-core.

outlines-core builds a regex from a schema, but it drops some keywords without a word
(`minimum`, `not`, `patternProperties`...), reads `allOf` as a concatenation, and lets a
`pattern` or its `email` and `time` formats match text a JSON string cannot hold. So the
schema is walked here first: every keyword must be on the allow-list below, or the walk
raises a `ValueError` naming it and its path; local `$ref`s are inlined (a recursive one
unrolls `REF_DEPTH` levels deep); annotations are dropped; `date`, `time` and `date-time`
become ASCII patterns of our own.
"""

import json
import re
from typing import Any


REF_DEPTH = 3
# How deep an object or array without a schema for its contents nests (outlines-core's own
# `depth` key): at 1, its values may be objects or arrays of scalars. 2 (outlines' default)
# takes seconds to compile even at a 256-token vocabulary.
GENERIC_DEPTH = 1
ANNOTATIONS = frozenset({"title", "description", "$schema", "$id", "$comment", "default", "examples"})
_CONTAINERS = frozenset({"$defs", "definitions"})
_TYPES = ("string", "integer", "number", "boolean", "null", "array", "object")
_BY_TYPE = {
    "string": {"minLength", "maxLength", "pattern", "format"},
    "array": {"items", "minItems", "maxItems"},
    "object": {"properties", "required", "additionalProperties"},
}
SUPPORTED = sorted(
    {"type", "enum", "const", "anyOf", "oneOf", "$ref", *_CONTAINERS, *ANNOTATIONS}
    | set().union(*_BY_TYPE.values())
)
_DATE = r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
_TIME = r"([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]{1,6})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])?"
FORMATS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": f"{_DATE}T{_TIME}",
    "uuid": "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
}
# One character of a JSON string that needs no escape (outlines-core's own class).
UNESCAPED_CHAR = r'[^"\\\x00-\x1F\x7F-\x9F]'


def _fail(path: str, message: str) -> ValueError:
    return ValueError(f"JsonSchema: {message} (at {path or '#'} in the schema).")


def _kinds(value) -> set[str]:
    """The JSON types a scalar `enum`/`const` value has (an integer is also a number)."""
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int):
        return {"integer", "number"}
    if isinstance(value, float):
        return {"number", "integer"} if value.is_integer() else {"number"}
    if isinstance(value, str):
        return {"string"}
    return set()


def _bounds(node: dict, low: str, high: str, path: str) -> dict[str, int]:
    """The `low`/`high` bounds that `node` gives (`minItems`, `maxItems`), checked."""
    bounds = {}
    for key in (low, high):
        if key in node:
            if not isinstance(node[key], int) or isinstance(node[key], bool) or node[key] < 0:
                raise _fail(f"{path}/{key}", f"{key!r} must be an integer >= 0, got {json.dumps(node[key])}")
            bounds[key] = node[key]
    if bounds.get(low, 0) > bounds.get(high, float("inf")):
        raise _fail(path, f"{low!r} is above {high!r}")
    return bounds


class _Walk:
    """One walk over a schema: the root (for `$ref`s) and the refs being inlined."""

    def __init__(self, root: dict, pattern_check):
        self.root = root
        self.stack: list[str] = []
        self.pattern_check = pattern_check

    def node(self, node: Any, path: str) -> dict | None:
        """The rewritten schema of `node`, or `None` where no value can be written within
        the recursion bound."""
        if not isinstance(node, dict):
            raise _fail(path, f"a schema must be a JSON object, got {json.dumps(node)}; write {{}} for any value")
        keys = set(node) - ANNOTATIONS - (_CONTAINERS if path == "" else set())
        for key in sorted(keys):
            if key not in SUPPORTED or key in _CONTAINERS:
                raise _fail(
                    f"{path}/{key}",
                    f"the keyword {key!r} is not supported (it would be ignored, and the text "
                    f"might not validate); supported keywords: {', '.join(SUPPORTED)}",
                )
        for group in ("$ref", "anyOf", "oneOf", "enum", "const"):
            if group in keys:
                extra = keys - {group} - ({"type"} if group in ("enum", "const") else set())
                if extra:
                    raise _fail(path, f"{group!r} beside {sorted(extra)} is not supported; nest them under {group!r}")
        if "$ref" in keys:
            return self.ref(node["$ref"], f"{path}/$ref")
        if "anyOf" in keys or "oneOf" in keys:
            return self.union(node, "anyOf" if "anyOf" in keys else "oneOf", path)
        if "enum" in keys or "const" in keys:
            return self.values(node, path)
        if not keys:
            return {"anyOf": [{"type": t, "depth": GENERIC_DEPTH} if t in ("array", "object") else {"type": t} for t in _TYPES]}
        if "type" not in keys:
            raise _fail(path, f"{sorted(keys)} without 'type' is not supported; add a 'type'")
        return self.typed(node, keys, path)

    def ref(self, ref: Any, path: str) -> dict | None:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise _fail(path, f"only local references ('#/$defs/NAME') are supported, got {ref!r}")
        if self.stack.count(ref) >= REF_DEPTH:
            return None
        target: Any = self.root
        for part in ref[1:].split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                raise _fail(path, f"the reference {ref!r} names nothing in the schema")
            target = target[part]
        self.stack.append(ref)
        try:
            return self.node(target, ref[1:])
        finally:
            self.stack.pop()

    def union(self, node: dict, key: str, path: str) -> dict | None:
        branches = node[key]
        if not isinstance(branches, list) or not branches:
            raise _fail(f"{path}/{key}", f"{key!r} must be a non-empty list of schemas")
        done = [self.node(b, f"{path}/{key}/{i}") for i, b in enumerate(branches)]
        if key == "oneOf":
            self.disjoint(done, f"{path}/oneOf")
        done = [b for b in done if b is not None]
        return {"anyOf": done} if done else None

    def disjoint(self, branches: list, path: str) -> None:
        """`oneOf` is compiled as `anyOf`: refuse it unless no value can match two branches
        (branches of different types, or different constants)."""
        seen: list[tuple[set, list | None]] = []
        for i, branch in enumerate(branches):
            if branch is None:
                continue
            kinds, values = self.signature(branch)
            for other_kinds, other_values in seen:
                overlap = kinds & other_kinds
                if overlap and (values is None or other_values is None or any(v in other_values for v in values)):
                    raise _fail(
                        f"{path}/{i}",
                        "'oneOf' branches that one value could match together are not supported "
                        "(the text must match exactly one); use 'anyOf', or branches of different "
                        "types or constants",
                    )
            seen.append((kinds, values))

    def signature(self, branch: dict) -> tuple[set, list | None]:
        if "anyOf" in branch:
            parts = [self.signature(b) for b in branch["anyOf"]]
            values = [v for _, vs in parts if vs is not None for v in vs]
            return set().union(*(k for k, _ in parts)), None if any(vs is None for _, vs in parts) else values
        if "enum" in branch:
            return set().union(*(_kinds(v) for v in branch["enum"])), list(branch["enum"])
        kinds = branch.get("type", list(_TYPES))
        kinds = {kinds} if isinstance(kinds, str) else set(kinds)
        return kinds | ({"number"} if "integer" in kinds else set()) | (
            {"integer"} if "number" in kinds else set()
        ), None

    def values(self, node: dict, path: str) -> dict:
        key = "enum" if "enum" in node else "const"
        values = node["enum"] if key == "enum" else [node["const"]]
        if key == "enum" and (not isinstance(values, list) or not values):
            raise _fail(f"{path}/enum", "'enum' must be a non-empty list")
        types = node.get("type", list(_TYPES))
        types = [types] if isinstance(types, str) else types
        if not isinstance(types, list) or any(t not in _TYPES for t in types):
            raise _fail(f"{path}/type", f"'type' must be one of {list(_TYPES)} or a list of them, got {json.dumps(node['type'])}")
        types = set(types)
        for i, value in enumerate(values):
            where = f"{path}/{key}" + (f"/{i}" if key == "enum" else "")
            if not _kinds(value):
                raise _fail(where, f"only strings, numbers, booleans and null are supported in {key!r}, got {json.dumps(value)}")
            if not _kinds(value) & types:
                raise _fail(where, f"the value {json.dumps(value)} is not of the schema's type {sorted(types)}")
        return {"enum": list(values)}

    def typed(self, node: dict, keys: set, path: str) -> dict | None:
        types = node["type"]
        types = [types] if isinstance(types, str) else types
        if not isinstance(types, list) or not types or any(t not in _TYPES for t in types):
            raise _fail(f"{path}/type", f"'type' must be one of {list(_TYPES)} or a list of them, got {json.dumps(node['type'])}")
        allowed = {"type"}.union(*(_BY_TYPE.get(t, set()) for t in types))
        for key in sorted(keys - allowed):
            raise _fail(f"{path}/{key}", f"{key!r} does not apply to the type {types} here; remove it or change 'type'")
        if len(types) > 1:
            if keys - {"type"}:
                raise _fail(path, f"a list of types beside {sorted(keys - {'type'})} is not supported; use 'anyOf'")
            return {"type": list(types)}
        kind = types[0]
        if kind == "string":
            return self.string(node, keys, path)
        if kind == "array":
            return self.array(node, keys, path)
        if kind == "object":
            return self.object(node, keys, path)
        return {"type": kind}

    def string(self, node: dict, keys: set, path: str) -> dict:
        groups = [g for g in ({"minLength", "maxLength"}, {"pattern"}, {"format"}) if g & keys]
        if len(groups) > 1:
            raise _fail(path, f"{sorted(keys - {'type'})} together are not supported; use one of length bounds, 'pattern' or 'format'")
        out: dict = {"type": "string"}
        bounds = _bounds(node, "minLength", "maxLength", path)
        if bounds:
            # Without escapes: outlines-core 0.2.14 takes time exponential in the bound to
            # build `(char|escape){0,n}` (16 characters: seconds), but not `char{0,n}`.
            low, high = bounds.get("minLength", 0), bounds.get("maxLength", "")
            out["pattern"] = f"^{UNESCAPED_CHAR}{{{low},{high}}}$"
        if "pattern" in node:
            out["pattern"] = self.pattern(node["pattern"], f"{path}/pattern")
        if "format" in node:
            fmt = node["format"]
            if fmt not in FORMATS:
                raise _fail(f"{path}/format", f"the format {fmt!r} is not supported; supported: {sorted(FORMATS)} (or write a 'pattern')")
            out["pattern"] = f"^{FORMATS[fmt]}$"
        return out

    def pattern(self, pattern: Any, path: str) -> str:
        if not isinstance(pattern, str):
            raise _fail(path, f"'pattern' must be a string, got {json.dumps(pattern)}")
        core = pattern[1:] if pattern.startswith("^") else pattern
        if core.endswith("$") and not re.search(r"(^|[^\\])(\\\\)*\\\$$", core):
            core = core[:-1]
        self.pattern_check(core, path)
        return f"^(?:{core})$"  # outlines-core writes `("CORE")`: the group keeps `a|b` inside the quotes

    def array(self, node: dict, keys: set, path: str) -> dict | None:
        bounds = _bounds(node, "minItems", "maxItems", path)
        if "items" not in node:
            return {"type": "array", "depth": GENERIC_DEPTH, **bounds}
        if isinstance(node["items"], list):
            raise _fail(f"{path}/items", "a list of 'items' (a tuple) is not supported; give one schema")
        items = self.node(node["items"], f"{path}/items")
        if items is None:
            return None if bounds.get("minItems", 0) > 0 else {"type": "array", "maxItems": 0}
        return {"type": "array", "items": items, **bounds}

    def object(self, node: dict, keys: set, path: str) -> dict | None:
        extra = node.get("additionalProperties", None)
        if "properties" not in node:
            if "required" in node:
                raise _fail(f"{path}/required", "'required' without 'properties' is not supported; list them in 'properties'")
            if extra is False:
                return {"type": "object", "properties": {}}
            if extra is None or extra is True:
                return {"type": "object", "depth": GENERIC_DEPTH}
            values = self.node(extra, f"{path}/additionalProperties")
            return {"type": "object", "additionalProperties": values} if values is not None else {"type": "object", "properties": {}}
        if extra not in (None, False):
            raise _fail(
                f"{path}/additionalProperties",
                "only 'additionalProperties': false is supported beside 'properties' (the text "
                "holds only the listed properties, in their order)",
            )
        properties, required = node["properties"], node.get("required", [])
        if not isinstance(properties, dict):
            raise _fail(f"{path}/properties", "'properties' must be an object of schemas")
        if not isinstance(required, list) or any(r not in properties for r in required):
            raise _fail(f"{path}/required", f"'required' must list names of 'properties', got {json.dumps(required)}")
        out = {}
        for name, sub in properties.items():
            if json.dumps(name, ensure_ascii=False)[1:-1] != name:
                raise _fail(f"{path}/properties", f"the property name {name!r} needs escaping in JSON, which is not supported")
            done = self.node(sub, f"{path}/properties/{name}")
            if done is None and name in required:
                return None
            if done is not None:
                out[name] = done
        return {"type": "object", "properties": out, "required": [r for r in required if r in out]}


def rewrite(schema: Any, pattern_check) -> dict:
    """`schema`, checked and rewritten for outlines-core's `build_regex_from_schema`.

    **Arguments:**

    - `schema`: a JSON schema (a dict).
    - `pattern_check`: `pattern_check(regex, path)` raises a `ValueError` when a string
      `pattern` could match a character a JSON string must escape.

    **Returns:** a schema without `$ref`s and annotations. Raises `ValueError` naming the
    keyword and its path for anything outside the allow-list.
    """
    if not isinstance(schema, dict):
        raise TypeError(f"JsonSchema: schema must be a dict (a JSON schema), got {type(schema).__name__}.")
    done = _Walk(schema, pattern_check).node(schema, "")
    if done is None:
        raise _fail("", f"no value fits within the recursion bound of {REF_DEPTH} levels of each '$ref'")
    return done
