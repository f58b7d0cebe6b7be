"""Structured output through the server: OpenAI's `response_format` and vLLM's
`structured_outputs`, read into an `eqrope.Regex`, `Choice` or `JsonSchema`, compiled
against the tokenizer on a host thread, and handed to the engine as the request's
`constraint` (`Engine(constraint_capacity=)`, `python -m eqrope.serve --constraint-capacity`).

- `response_format`: `{"type": "text"}` (nothing), `{"type": "json_object"}` (a JSON
  object whose values are JSON values at most one more level deep: `JSON_OBJECT`, a
  bounded grammar, so that the text always ends), `{"type": "json_schema", "json_schema":
  {"name", "schema", "strict", "description"}}` (`strict` or not, the schema is enforced).
- `structured_outputs`: one of `{"json": SCHEMA}` (an object or its JSON text),
  `{"regex": PATTERN}`, `{"choice": [...]}` or `{"json_object": true}`.

A schema outside `eqrope.JsonSchema`'s keyword list is a 400 naming the keyword. The
compile runs on a thread of its own (never the engine's: the running requests go on
decoding), and past `--structured-timeout` seconds the request is answered 408; the
compile goes on, and its automaton is cached for the next request that asks for it. A
request for a spec whose compile is still running waits for that compile instead of
starting another, so a client that retries after a 408, as the answer says to, never
holds a second thread with the same work.
"""

import asyncio
import concurrent.futures
import json
import threading

from ... import structured
from ...structured._compile import outlines_core
from .._constraints import fits, size
from ._errors import APIError, bad_field

JSON_OBJECT = {"type": "object"}  # values nested at most one level more (eqrope.JsonSchema)
FIELDS = ("response_format", "structured_outputs")
_ENABLE = (
    "this server runs without structured output; start it with --constraint-capacity STATES,EXCEPTIONS "
    '(and the [structured] extra: pip install "eqrope[structured]")'
)


def requested_spec(body: dict):
    """The request's structured-output spec and the field that asked for it, or `None`
    (no field, or `response_format` `{"type": "text"}`); a 400 naming the field for a
    malformed one."""
    given = [name for name in FIELDS if body.get(name) is not None]
    if len(given) > 1:
        raise bad_field("structured_outputs", "send response_format or structured_outputs, not both.")
    if not given:
        return None
    name = given[0]
    value = body[name]
    spec = _response_format(value) if name == "response_format" else _structured_outputs(value)
    return None if spec is None else (spec, name)


def _response_format(value):
    kinds = '{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": {...}}'
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise bad_field("response_format", f"response_format must be {kinds}, got {json.dumps(value)[:200]}.")
    kind = value["type"]
    _only(value, {"type", "json_schema"} if kind == "json_schema" else {"type"}, "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return structured.JsonSchema(JSON_OBJECT)
    inner = value.get("json_schema")
    if not isinstance(inner, dict) or not isinstance(inner.get("schema"), dict):
        raise bad_field(
            "response_format",
            'response_format.json_schema must be {"name": ..., "schema": {...}, "strict": true}, '
            "with the JSON schema as an object.",
        )
    _only(inner, {"name", "schema", "strict", "description"}, "response_format.json_schema")
    if not isinstance(inner.get("strict", True), (bool, type(None))):
        raise bad_field("response_format", "response_format.json_schema.strict must be true or false.")
    return _schema(inner["schema"], "response_format")


def _structured_outputs(value):
    shapes = '{"json": SCHEMA}, {"regex": PATTERN}, {"choice": [STRINGS]} or {"json_object": true}'
    if not isinstance(value, dict):
        raise bad_field("structured_outputs", f"structured_outputs must be one of {shapes}.")
    _only(value, {"json", "regex", "choice", "json_object"}, "structured_outputs")
    given = {k: v for k, v in value.items() if v is not None and v is not False}
    if len(given) != 1:
        raise bad_field("structured_outputs", f"structured_outputs takes exactly one of {shapes}.")
    (kind, spec), = given.items()  # fmt: skip
    try:
        if kind == "json":
            return _schema(json.loads(spec) if isinstance(spec, str) else spec, "structured_outputs")
        if kind == "regex":
            return structured.Regex(spec)
        if kind == "choice":
            return structured.Choice(spec)
        if spec is not True:
            raise ValueError("structured_outputs.json_object must be true.")
        return structured.JsonSchema(JSON_OBJECT)
    except (TypeError, ValueError) as e:  # json.JSONDecodeError is a ValueError
        raise bad_field("structured_outputs", f"structured_outputs.{kind}: {e}") from None


def _schema(schema, field: str):
    if not isinstance(schema, dict):
        raise bad_field(field, f"{field}: the JSON schema must be an object, got {type(schema).__name__}.")
    try:
        return structured.JsonSchema(schema)
    except (TypeError, ValueError) as e:
        raise bad_field(field, str(e)) from None


def _only(value: dict, allowed: set, where: str) -> None:
    extra = sorted(set(value) - allowed)
    if extra:
        field = where.split(".")[0]
        raise bad_field(field, f"{where} has unknown fields {extra}; it takes {sorted(allowed)}.")


class Compiler:
    """Compiles specs against the tokenizer on its own threads, within a timeout.

    **Arguments:** `tokenizer`; `vocab`, the model's vocabulary; `capacity`, the engine's
    `constraint_capacity` (`None`: structured output is off, and asking for it is a 400);
    `timeout`, seconds before a request is answered 408.
    """

    def __init__(self, tokenizer, vocab: int, capacity, timeout: float):
        self.tokenizer, self.vocab, self.capacity, self.timeout = tokenizer, vocab, capacity, timeout
        if capacity is not None:
            outlines_core()  # an ImportError naming the [structured] extra
        self.pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="eqrope-structured")
        # (spec, field) -> the future of its compile, while it runs; the pool's threads
        # forget a compile when it ends.
        self.running: dict[tuple, concurrent.futures.Future] = {}
        self.lock = threading.Lock()

    async def compile(self, requested):
        """The `Automaton` of `requested_spec(body)`'s answer (`None` for none)."""
        if requested is None:
            return None
        spec, field = requested
        if self.capacity is None:
            raise bad_field(field, f"{field} asks for structured output, but {_ENABLE}.")
        future = asyncio.wrap_future(self._start(spec, field))
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.timeout)
        except TimeoutError:
            raise APIError(
                408, f"Compiling the {field} took more than the server's --structured-timeout of "
                f"{self.timeout:g} s; simplify the schema, or retry (the compile goes on, and is cached).",
                param=field, code="structured_output_timeout",
            ) from None  # fmt: skip

    def _start(self, spec, field: str) -> concurrent.futures.Future:
        """The running compile of `spec` for `field`, or a new one on the pool."""
        key = (spec, field)
        with self.lock:
            future = self.running.get(key)
            if future is None:
                future = self.pool.submit(self._compile, spec, field)
                self.running[key] = future
        # Forgotten once done: a finished automaton is in the spec cache
        # (`eqrope.structured`), and a failed compile is tried afresh.
        future.add_done_callback(lambda f: self._forget(key, f))
        return future

    def _forget(self, key: tuple, future: concurrent.futures.Future) -> None:
        with self.lock:
            if self.running.get(key) is future:
                del self.running[key]

    def _compile(self, spec, field: str):
        try:
            automaton = spec.compile(self.tokenizer, vocab=self.vocab)
        except (ValueError, TypeError, ImportError) as e:
            raise bad_field(field, f"{field}: {e}") from None
        if not fits(automaton, self.capacity):
            states, exceptions = size(automaton)
            raise bad_field(
                field,
                f"{field} compiles to {states + 1} automaton states (with FREE and a spare one) and "
                f"{exceptions} exceptions, more than this server's --constraint-capacity "
                f"{self.capacity[0]},{self.capacity[1]}; simplify it, or restart the server with a larger one.",
            )
        return automaton

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
