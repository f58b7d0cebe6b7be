"""Structured output through `python -m eqrope.serve --constraint-capacity` (issue 41 item 3):
OpenAI's `response_format` and vLLM's `structured_outputs`, from the `openai` client and
httpx, against a real server process on 127.0.0.1 (one for the module).

The answers are checked with `json.loads` and `jsonschema`, Python's `re.fullmatch`, and a
greedy answer with `eqrope.generate(..., constraint=)` on the checkpoint read here.
"""

import asyncio
import json
import re
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import eqrope

from _serve import serve
from test_serve import MAX_LEN, checkpoint, local  # noqa: F401 (the module's checkpoint, read here)

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
httpx = pytest.importorskip("httpx")
pytest.importorskip("outlines_core")  # the [structured] extra

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "ok", "tags"],
}
REGEX = r"[0-9]{2,4}-[a-z]{1,3}"
# A schema whose compile takes a while (about 1 s here, alone): 9 strings of up to 48 bytes.
HEAVY = {
    "type": "object",
    "properties": {f"field{i}": {"type": "string", "maxLength": 48} for i in range(9)},
    "required": [f"field{i}" for i in range(9)],
}


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):  # noqa: F811
    args = ("--slots", "4", "--max-len", str(MAX_LEN), "--served-model-name", "served", "--constraint-capacity", "8192,65536")
    with serve(checkpoint, *args, log_dir=tmp_path_factory.mktemp("logs")) as s:
        yield s
    assert s.process.returncode == 0, s.text()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_json_schema_response_format_validates(client):
    format_ = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA, "strict": True}}
    messages = [{"role": "user", "content": "A record, please."}]
    out = client.chat.completions.create(
        model="served", messages=messages, response_format=format_, temperature=1.0, n=3, seed=7, max_tokens=60
    )
    assert len(out.choices) == 3
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_json_object_is_an_object(client):
    out = client.chat.completions.create(
        model="served", messages=[{"role": "user", "content": "JSON"}], response_format={"type": "json_object"},
        temperature=0.7, seed=3, max_tokens=90,
    )  # fmt: skip
    assert out.choices[0].finish_reason == "stop", out.choices[0].message.content
    assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_the_docs_server_example_runs_as_written(server):
    """docs/structured.md's Python block for the server (skipped by the docs test, which has
    no server), run here as written with this server's address and model name put in."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "structured.md").read_text()
    section = page.split("## Through the server", 1)[1].split("\n## ", 1)[0]
    (block,) = [b.split("```", 1)[0] for b in section.split("```python\n")[1:]]
    assert "http://127.0.0.1:8000/v1" in block and '"my-checkpoint"' in block
    block = block.replace("http://127.0.0.1:8000", server.url).replace('"my-checkpoint"', '"served"')
    namespace = {}
    exec(compile(block, "docs/structured.md", "exec"), namespace)
    jsonschema.validate(namespace["person"], namespace["person_schema"])
    assert namespace["label"].choices[0].text in ("positive", "negative")


def test_structured_outputs_regex_is_generates_greedy_answer(client, local):  # noqa: F811
    model, tok = local
    out = client.completions.create(
        model="served", prompt="The cat", temperature=0, max_tokens=30, extra_body={"structured_outputs": {"regex": REGEX}}
    )
    text = out.choices[0].text
    assert re.fullmatch(REGEX, text), text
    ids = np.asarray(tok.encode("The cat"), np.int32)
    constraint = eqrope.Regex(REGEX).compile(tok, vocab=model.config.vocab_size)
    alone = eqrope.generate(model, ids, 30, eos_id=list(tok.eos_ids), constraint=constraint)
    new = np.asarray(alone)[len(ids) :].tolist()
    assert text == tok.decode(new[: new.index(1)] if 1 in new else new)


def test_structured_outputs_choice_through_the_chat_route(client):
    choices = ["red", "green", "blue sky"]
    out = client.chat.completions.create(
        model="served", messages=[{"role": "user", "content": "A colour?"}], temperature=1.5, n=4, seed=11,
        extra_body={"structured_outputs": {"choice": choices}},
    )  # fmt: skip
    assert all(c.message.content in choices for c in out.choices), [c.message.content for c in out.choices]


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer", "minimum": 3}}}},
     "response_format", "minimum"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}}, "response_format", "schema"),
    ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs", "grammar"),
    ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "non-empty"),
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs", "cannot compile"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs", "json"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs", "not both"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "param", "named"), BAD)
def test_bad_structured_requests_get_400s_naming_the_field(server, extra, param, named):
    for route, base in (("completions", {"prompt": "x"}), ("chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        r = httpx.post(f"{server.url}/v1/{route}", json={**base, **extra, "max_tokens": 4}, timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
        assert named in error["message"], error["message"]


def test_running_requests_stream_while_a_schema_compiles(server, client):
    """A request with a schema nobody compiled yet waits for its compile on a host thread;
    streamed requests that start after it finish before its answer comes."""
    window = {}

    def heavy():
        window["start"] = time.monotonic()
        window["answer"] = client.chat.completions.create(
            model="served", messages=[{"role": "user", "content": "x"}], max_tokens=1,
            response_format={"type": "json_schema", "json_schema": {"name": "heavy", "schema": HEAVY}},
        )  # fmt: skip
        window["end"] = time.monotonic()

    thread = threading.Thread(target=heavy)
    thread.start()
    body = {"prompt": "The cat", "max_tokens": 8, "temperature": 0, "stream": True, "ignore_eos": True}
    finished = []  # (first chunk, last chunk) of each streamed request
    for _ in range(200):  # bounded: the compile takes a few seconds at most
        if "end" in window:
            break
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            times = [time.monotonic() for line in r.iter_lines() if line.startswith("data: {")]
        finished.append((times[0], times[-1]))
    thread.join(120)
    assert window["answer"].usage.completion_tokens == 1
    inside = [f for f in finished if window["start"] < f[0] and f[1] < window["end"]]
    assert inside, (window, finished[:3])


def test_a_retry_after_a_408_waits_for_the_running_compile(local, monkeypatch):  # noqa: F811
    """The 408 says to retry; a retry (or any request for the same spec) while the compile
    still runs joins it instead of starting the same work on a second thread."""
    from eqrope.serving.server import _structured
    from eqrope.serving.server._errors import APIError

    release, calls = threading.Event(), []
    automaton = object()

    class Held:  # hashable, as eqrope's frozen specs are
        def compile(self, tokenizer, vocab):
            calls.append(time.monotonic())
            assert release.wait(30)
            return automaton

    _, tok = local
    compiler = _structured.Compiler(tok, 320, (64, 1024), timeout=0.05)
    monkeypatch.setattr(_structured, "fits", lambda a, capacity: True)  # the stand-in has no tables
    spec = (Held(), "response_format")

    async def scenario():
        with pytest.raises(APIError) as error:
            await compiler.compile(spec)
        assert error.value.status == 408
        compiler.timeout = 30.0
        # Two retries and one request for another field, all while the first compile runs.
        retries = [asyncio.create_task(compiler.compile(spec)) for _ in range(2)]
        other = asyncio.create_task(compiler.compile((spec[0], "structured_outputs")))
        await asyncio.sleep(0.2)
        assert not any(t.done() for t in (*retries, other))
        release.set()
        return await asyncio.gather(*retries, other)

    answers = asyncio.run(scenario())
    assert all(a is automaton for a in answers)
    # One compile for the response_format spec (the 408's and both retries'), one for the
    # other field (its errors name its own field).
    assert len(calls) == 2
    for _ in range(100):  # bounded: the pool's threads forget each compile as it ends
        if not compiler.running:
            break
        time.sleep(0.01)
    assert compiler.running == {}
    compiler.close()


def test_a_compile_past_the_timeout_is_a_408_and_no_capacity_a_400(local, monkeypatch):  # noqa: F811
    from eqrope.serving.server._errors import APIError
    from eqrope.serving.server._structured import Compiler

    class Slow:
        def compile(self, tokenizer, vocab):
            time.sleep(0.5)

    _, tok = local
    compiler = Compiler(tok, 320, (64, 1024), timeout=0.05)
    with pytest.raises(APIError) as error:
        asyncio.run(compiler.compile((Slow(), "response_format")))
    assert error.value.status == 408 and error.value.param == "response_format"
    assert "--structured-timeout" in error.value.message
    off = Compiler(tok, 320, None, timeout=1.0)
    with pytest.raises(APIError) as error:
        asyncio.run(off.compile((eqrope.Regex("a+"), "structured_outputs")))
    assert error.value.status == 400 and "--constraint-capacity" in error.value.message
    compiler.close()
    off.close()
    monkeypatch.setitem(sys.modules, "outlines_core", None)  # as if the extra were not installed
    with pytest.raises(ImportError, match=r'pip install "eqrope\[structured\]"'):
        Compiler(tok, 320, (64, 1024), timeout=1.0)
