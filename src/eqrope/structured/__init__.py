"""Structured output: a regex, a choice list or a JSON schema compiled against a tokenizer
into an `Automaton` (the `[structured]` extra: outlines-core) that generation carries per row.
"""

from ._specs import Choice as Choice, JsonSchema as JsonSchema, Regex as Regex
