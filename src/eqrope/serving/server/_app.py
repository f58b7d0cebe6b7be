"""The HTTP routes: OpenAI's `/v1/completions`, `/v1/chat/completions` and `/v1/models`;
vLLM's `/tokenize`, `/detokenize` and `/tokenizer_info`; `/health` and `/metrics`.

A Starlette app. The routes only translate: a body becomes a checked `Job`
(`_requests.py`), the job runs on the engine's thread (`_run.py`, `_worker.py`), and its
result becomes OpenAI's JSON (`_responses.py`). Everything that goes wrong answers in
OpenAI's error shape (`_errors.py`): a client's mistake is a 4xx, never a 5xx.
"""

import asyncio
import contextlib
import json
import logging
import time

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from . import _fields as f
from ._errors import APIError, bad_field
from ._requests import chat_job, chat_prompt, completion_job
from ._responses import Answer
from ._run import JobRun


_log = logging.getLogger("eqrope.serving")


def build_app(server) -> Starlette:
    """The app of `server` (a `Server`): its routes, error handlers and lifespan (the
    engine's thread starts with the app and stops after uvicorn drains the requests)."""

    async def completions(request: Request):
        return await _generate(server, request, completion_job)

    async def chat(request: Request):
        return await _generate(server, request, chat_job)

    async def models(request: Request):
        server.authorize(request)
        card = {"id": server.name, "object": "model", "created": server.created, "owned_by": "eqrope",
                "root": server.source, "max_model_len": server.limits.max_len}  # fmt: skip
        return JSONResponse({"object": "list", "data": [card]})

    async def tokenize(request: Request):
        body = await _json(request)
        server.check_model(f.string(body, "model", ""))
        if f.get(body, "messages") is not None:
            ids = chat_prompt(body["messages"], server.tokenizer, f.boolean(body, "add_generation_prompt", True))
        else:
            prompt = f.get(body, "prompt")
            if not isinstance(prompt, str):
                raise bad_field("prompt", "prompt must be a string (or send messages).")
            ids = server.tokenizer.encode(prompt, add_special_tokens=f.boolean(body, "add_special_tokens", True))
        return JSONResponse({"count": len(ids), "max_model_len": server.limits.max_len, "tokens": ids, "token_strs": None})

    async def detokenize(request: Request):
        body = await _json(request)
        server.check_model(f.string(body, "model", ""))
        ids = f.token_ids(f.get(body, "tokens"), "tokens", server.limits.vocab)
        return JSONResponse({"prompt": server.tokenizer.decode(ids)})

    async def tokenizer_info(request: Request):
        tok = server.tokenizer
        return JSONResponse({
            "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": tok.chat_template,
            "model_max_length": server.limits.max_len, **tok.special_tokens,
        })  # fmt: skip

    async def health(request: Request):
        if not server.worker.alive:
            raise APIError(503, "The engine's thread has stopped.", type="server_error", code="engine_dead")
        return Response(status_code=200)

    async def metrics(request: Request):
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.worker.start()
        yield
        server.worker.stop()

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/tokenizer_info", tokenizer_info, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    handlers = {APIError: _api_error, HTTPException: _http_error, Exception: _fault}
    return Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)


async def _generate(server, request: Request, make_job):
    arrival = time.perf_counter()
    server.authorize(request)
    body = await _json(request)
    job = make_job(body, server.tokenizer, server.limits, server.defaults)
    server.check_model(job.model)
    constraint = await server.compiler.compile(job.structured)
    run = JobRun(job, server, arrival, constraint)
    server.admit(run.samples)
    try:
        run.start()
        answer = Answer(run, server.name)
    except BaseException:
        server.release(run.samples)
        raise
    close = _closer(server, run)
    if job.stream:
        return _Stream(_stream(run, answer, close), close)
    try:
        return JSONResponse(await _unless_disconnected(request, _whole(run, answer), run))
    finally:
        close()


def _closer(server, run: JobRun):
    """Once, however the request ends: cancel what still runs, and release its samples."""
    closed = False

    def close() -> None:
        nonlocal closed
        if not closed:
            closed = True
            run.cancel()
            server.release(run.samples)

    return close


class _Stream(StreamingResponse):
    """Server-sent events that close their run even when the client leaves before the
    first byte (the body's generator then never starts, so its own `finally` never runs)."""

    def __init__(self, body, close):
        super().__init__(body, media_type="text/event-stream")
        self.close = close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.close()


async def _whole(run: JobRun, answer: Answer) -> dict:
    try:
        async for _ in run.events():
            pass
        return await answer.whole()
    except BaseException:
        run.cancel()
        raise


async def _stream(run: JobRun, answer: Answer, close):
    """Server-sent events: a chunk per choice as its text grows, the usage chunk if asked,
    and `data: [DONE]`. An error after the first byte is sent as an error event."""
    opened, closed = set(), set()

    async def chunks():
        for choice in run.choices:
            if choice.index in closed:
                continue
            chunk = await answer.chunk(choice, first=choice.index not in opened)
            if chunk is not None:
                opened.add(choice.index)
                if chunk["choices"][0]["finish_reason"] is not None:
                    closed.add(choice.index)
                yield _event(chunk)

    try:
        async for piece in chunks():
            yield piece
        async for _ in run.events():
            async for piece in chunks():
                yield piece
        if run.job.include_usage:
            yield _event(answer.usage_chunk())
    except APIError as e:
        yield _event(e.body())
    except Exception as e:  # noqa: BLE001 (the stream is open: report, then end it)
        _log.exception("a streamed request failed")
        yield _event(APIError(500, f"{type(e).__name__}: {e}", type="server_error").body())
    finally:
        close()
    yield "data: [DONE]\n\n"


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def _unless_disconnected(request: Request, work, run: JobRun):
    """Await `work`; if the client disconnects first, cancel the run (its slots and
    pages are freed at the engine's next step)."""
    task = asyncio.ensure_future(work)

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task in done:
        return task.result()
    task.cancel()
    run.cancel()
    raise APIError(499, "The client closed the connection.", code="client_closed_request")


async def _json(request: Request):
    raw = await request.body()
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise APIError(400, f"The request body is not valid JSON: {e}", code="invalid_json") from None


async def _api_error(request: Request, exc: APIError):
    return exc.response()


async def _http_error(request: Request, exc: HTTPException):
    kind = "not_found" if exc.status_code == 404 else "method_not_allowed" if exc.status_code == 405 else None
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return APIError(exc.status_code, message, code=kind).response()


async def _fault(request: Request, exc: Exception):
    _log.exception("a request failed inside the server")
    return APIError(500, f"{type(exc).__name__}: {exc}", type="server_error", code="internal_error").response()

