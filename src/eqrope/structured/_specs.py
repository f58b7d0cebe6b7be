"""`Regex`, `Choice` and `JsonSchema`: what the text must be, compiled against a tokenizer
into an `Automaton` that the generate loop carries per row."""

import dataclasses
import functools
import json
from collections.abc import Sequence
from typing import Any

from .._checks import check_int
from .._custom_types import IntLike
from ..generation._automaton import Automaton
from ._compile import compile_regex, json_pattern_check, outlines_core
from ._schema import rewrite


MAX_STATES = 4096
WHITESPACE = {"compact": "", "flexible": "[ ]?"}


def _check_max_states(value, who: str) -> int:
    return check_int(value, f"{who}: max_states (default {MAX_STATES})", minimum=1)


def escape(text: str) -> str:
    """`text` as a regex (outlines-core's Rust syntax) that matches it alone: every
    character but ASCII letters and digits written as `\\x{HEX}`."""
    return "".join(c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):x}}}" for c in text)


class _Spec:
    """What the three specs share: `compile`."""

    max_states: int

    def regex(self) -> str:
        raise NotImplementedError

    def compile(self, tokenizer, vocab: IntLike | None = None) -> Automaton:
        """The constraint as an `Automaton` over `tokenizer`'s token ids.

        **Arguments:**

        - `tokenizer`: an `eqrope.Tokenizer`; the bytes each token spells
          (`tokenizer.token_bytes()`) are what the constraint matches. Tokens that spell
          nothing (special tokens) are never allowed.
        - `vocab`: the number of ids the table covers: the model's vocabulary size, which
          may be larger than the tokenizer's (the default). Ids past the tokenizer's are
          never allowed.

        **Returns:** an `eqrope.generation._automaton.Automaton`, cached (by the regex the
        spec compiles to, the tokenizer's token bytes, `vocab` and `max_states`).

        Raises `ImportError` without outlines-core (`pip install "eqrope[structured]"`),
        and `ValueError` for a constraint past `max_states` states, one outlines-core
        cannot compile, or one no text of this tokenizer satisfies.
        """
        return compile_regex(self.regex(), tokenizer, vocab, self.max_states, type(self).__name__)


@dataclasses.dataclass(frozen=True)
class Regex(_Spec):
    """Text that matches a regular expression as a whole.

    **Arguments:**

    - `pattern`: a regex in the syntax of Rust's `regex` crate (which outlines-core
      compiles): much like Python's `re`, without backreferences or lookaround; `\\d`,
      `\\w` and `.` are Unicode-aware; the whole text must match (no anchors needed).
    - `max_states`: the most automaton states the compiled constraint may have (default
      4096); past it `compile` raises a `ValueError`.
    """

    pattern: str
    max_states: IntLike = MAX_STATES

    def __post_init__(self):
        if not isinstance(self.pattern, str):
            raise TypeError(f"Regex: pattern must be a str, got {type(self.pattern).__name__}.")
        object.__setattr__(self, "max_states", _check_max_states(self.max_states, "Regex"))

    def regex(self) -> str:
        return self.pattern


@dataclasses.dataclass(frozen=True)
class Choice(_Spec):
    """Text that is exactly one of the given strings.

    **Arguments:**

    - `choices`: a non-empty sequence of strings.
    - `max_states`: as for [`eqrope.Regex`][].
    """

    choices: tuple[str, ...]
    max_states: int = MAX_STATES

    def __init__(self, choices: Sequence[str], max_states: IntLike = MAX_STATES):
        if isinstance(choices, str) or not isinstance(choices, Sequence) or not choices:
            raise ValueError(f"Choice: choices must be a non-empty list of strings, like ['yes', 'no'], got {choices!r}.")
        for i, c in enumerate(choices):
            if not isinstance(c, str):
                raise TypeError(f"Choice: choices[{i}] must be a str, got {type(c).__name__}.")
        object.__setattr__(self, "choices", tuple(choices))
        object.__setattr__(self, "max_states", _check_max_states(max_states, "Choice"))

    def regex(self) -> str:
        return "|".join(f"(?:{escape(c)})" for c in dict.fromkeys(self.choices))


@dataclasses.dataclass(frozen=True)
class JsonSchema(_Spec):
    """JSON text valid under a JSON schema, from a keyword allow-list.

    **Arguments:**

    - `schema`: a JSON schema (a dict). Supported keywords: `type` (one or a list),
      `properties`, `required`, `additionalProperties` (`false` beside `properties`;
      `true` or a schema for an object without them), `items`, `minItems`, `maxItems`,
      `enum`, `const`, `minLength`, `maxLength`, `pattern`, `format` (`date`, `time`,
      `date-time`, `uuid`), `anyOf`, `oneOf` (branches no value matches together), local
      `$ref` with `$defs`/`definitions` (a recursive one unrolls 3 levels deep), and the
      annotations `title`, `description`, `$schema`, `$id`, `$comment`, `default`,
      `examples`. Anything else raises a `ValueError` naming the keyword and its path.
      A string with `minLength`/`maxLength` holds no escapes (`\\n`, `\\"`): outlines-core
      takes time exponential in the bound to build one that does. Properties come in the
      schema's order; an object without `properties` is any JSON
      object whose values are JSON values with at most one more level of objects or
      arrays (`{"a": [1, "x"], "b": {"c": null}}`, not `{"a": [[1]]}`); an array without
      `items` and the empty schema `{}` likewise.
    - `whitespace`: `"compact"` (the default: no whitespace between tokens, so a bounded
      schema always finishes) or `"flexible"` (at most one space around each `:`, `,`,
      and inside brackets).
    - `max_states`: as for [`eqrope.Regex`][].
    """

    schema_json: str
    whitespace: str = "compact"
    max_states: int = MAX_STATES

    def __init__(self, schema: dict[str, Any], whitespace: str = "compact", max_states: IntLike = MAX_STATES):
        if not isinstance(schema, dict):
            raise TypeError(f"JsonSchema: schema must be a dict (a JSON schema), got {type(schema).__name__}.")
        if whitespace not in WHITESPACE:
            raise ValueError(f"JsonSchema: whitespace must be one of {sorted(WHITESPACE)}, got {whitespace!r}.")
        try:
            canonical = json.dumps(schema, sort_keys=False, ensure_ascii=False, separators=(",", ":"))
        except (TypeError, ValueError) as e:
            raise ValueError(f"JsonSchema: schema must be JSON ({e}).") from None
        object.__setattr__(self, "schema_json", canonical)
        object.__setattr__(self, "whitespace", whitespace)
        object.__setattr__(self, "max_states", _check_max_states(max_states, "JsonSchema"))

    @property
    def schema(self) -> dict[str, Any]:
        """The schema, as given."""
        return json.loads(self.schema_json)

    def regex(self) -> str:
        return _schema_regex(self.schema_json, self.whitespace)


@functools.lru_cache(maxsize=64)
def _schema_regex(schema_json: str, whitespace: str) -> str:
    """The regex of a schema (its allow-list walk and pattern checks run once)."""
    build = outlines_core().json_schema.build_regex_from_schema
    rewritten = rewrite(json.loads(schema_json), json_pattern_check)
    try:
        return build(json.dumps(rewritten), WHITESPACE[whitespace])
    except (ValueError, RuntimeError) as e:
        raise ValueError(f"JsonSchema: outlines-core cannot compile it ({e}).") from None
