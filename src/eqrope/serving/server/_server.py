"""`Server`: what the routes share (the model, its tokenizer, the engine's thread, the
metrics and the limits), and the checks every request passes first: the API key, the
model's name, and admission (the most samples held at once)."""

import hmac
import time

import jax

from ..._checks import check_int
from ..._custom_types import IntLike
from .._engine import Engine
from .._processes import dismiss, leading
from ._errors import APIError, bad_field, overloaded
from ._metrics import Metrics
from ._requests import Limits
from ._structured import Compiler
from ._worker import Worker


class Server:
    """One model served.

    **Arguments:**

    - `model`, `tokenizer`: an `eqrope.RotaryDecoder` and its `eqrope.Tokenizer`.
    - `name`: the model's name in requests and in `/v1/models`; `source`: where it came from.
    - `slots`, `max_len`, `page_size`, `prefill_chunk`, `decode_steps`: the engine's
      (`eqrope.Engine`).
    - `max_waiting`: the most samples waiting beyond those in slots; past `slots +
      max_waiting` samples held, a request is answered 503 with `Retry-After`.
    - `api_key`: the key every `/v1` route asks for, or `None`.
    - `defaults`: the sampling defaults from the checkpoint's `generation_config.json`.
    - `warmup`: compile every engine program before serving.
    - `constraint_capacity`: the engine's table of structured-output automata,
      `(states, exceptions)` (`eqrope.Engine`'s); `None`: requests with
      `response_format` or `structured_outputs` are answered 400 (`_structured.py`).
    - `structured_timeout`: seconds a request waits for its schema's compile before a 408.
    - `mesh`: the engine's device mesh (`eqrope.Engine`'s `mesh`), or `None`. On a mesh
      over several processes this is process 0's server: the others follow its engine
      (`eqrope.serving.follow`, `python -m eqrope.serve --process-id`).
    """

    def __init__(
        self, model, tokenizer, *, name: str, source: str = "", slots: IntLike = 8, max_len: IntLike | None = None,
        page_size: IntLike = 16, prefill_chunk: IntLike = 64, decode_steps: IntLike = 16, max_waiting: IntLike = 64,
        api_key: str | None = None, defaults: dict | None = None, warmup: bool = True, mesh=None,
        constraint_capacity: tuple[IntLike, IntLike] | None = None, structured_timeout: float = 10.0,
    ):  # fmt: skip
        if tokenizer.vocab_size > model.config.vocab_size:
            raise ValueError(
                f"the tokenizer has {tokenizer.vocab_size} ids but the model's vocabulary has "
                f"{model.config.vocab_size}: they do not belong together."
            )
        self.model, self.tokenizer = model, tokenizer
        self.name, self.source, self.api_key = name, source, api_key
        self.created = int(time.time())
        self.defaults = dict(defaults or {})
        engine_args = engine_arguments(
            model, slots, max_len, page_size, prefill_chunk, decode_steps, max_waiting, mesh, constraint_capacity
        )
        if not structured_timeout > 0:
            raise ValueError(f"structured_timeout must be a positive number of seconds, got {structured_timeout}.")
        self.compiler = Compiler(tokenizer, model.config.vocab_size, engine_args["constraint_capacity"], structured_timeout)
        self.capacity, slots, max_len = engine_args["max_waiting"], engine_args["slots"], engine_args["max_len"]
        self.limits = Limits(max_len=max_len, vocab=model.config.vocab_size, max_n=slots)
        self.metrics = Metrics(name)
        make = lambda: Engine(model, **engine_args)
        self.worker = Worker(leading(make) if jax.process_count() > 1 else make, on_step=self.metrics.on_step)
        if warmup:
            self.worker.engine.warmup()
        self.held = 0  # samples of the requests in flight

    def close(self) -> None:
        """After serving: end the other processes' `follow`, if any."""
        self.compiler.close()
        if jax.process_count() > 1:
            dismiss(self.worker.engine)

    def authorize(self, request) -> None:
        """`Authorization: Bearer KEY` on every `/v1` route, when the server has a key."""
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            raise APIError(
                401, "Incorrect API key provided: send the server's --api-key as 'Authorization: Bearer KEY'.",
                code="invalid_api_key",
            )  # fmt: skip

    def check_model(self, model: str) -> None:
        """An empty name means this server's one model (as vLLM takes it)."""
        if model and model != self.name:
            raise APIError(
                404, f"The model `{model}` does not exist: this server serves `{self.name}`.",
                param="model", code="model_not_found",
            )  # fmt: skip

    def admit(self, samples: int) -> None:
        """Hold `samples` more, or refuse: 400 if they could never fit, 503 if not now."""
        if samples > self.capacity:
            raise bad_field(
                "n", f"The request asks for {samples} samples (prompts times n); this server holds at most {self.capacity}."
            )
        if self.held + samples > self.capacity:
            raise overloaded(self.capacity)
        self.held += samples

    def release(self, samples: int) -> None:
        self.held -= samples


def engine_arguments(
    model, slots, max_len, page_size, prefill_chunk, decode_steps, max_waiting, mesh, constraint_capacity=None
) -> dict:
    """The `eqrope.Engine` arguments of a server (the same in every process of one):
    its `max_waiting` holds the slots' samples too (the server's capacity)."""
    max_len = model.config.max_len if max_len is None else check_int(max_len, "max_len", minimum=1)
    slots = check_int(slots, "slots", minimum=1)
    prefill_chunk = check_int(prefill_chunk, "prefill_chunk", minimum=1)
    return dict(
        slots=slots, max_len=max_len, page_size=page_size, prefill_chunk=min(prefill_chunk, max_len),
        decode_steps=decode_steps, max_waiting=slots + check_int(max_waiting, "max_waiting", minimum=0), mesh=mesh,
        constraint_capacity=None if constraint_capacity is None else tuple(constraint_capacity),
    )  # fmt: skip
