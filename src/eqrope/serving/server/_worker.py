"""The engine's own thread: every JAX call of the server runs here, none on the asyncio loop.

The HTTP side puts commands into an inbox (`submit`, `cancel`, `call`) and never waits on
the device; this thread drains the inbox between engine steps, steps while there is work,
and posts each `Event` back to the asyncio loop of the request it belongs to
(`loop.call_soon_threadsafe`, as Levanter's server does). With no work it sleeps on the
inbox.

A step that raises fails the requests in flight with that error (a 500 each) and the
engine is built again from its arguments (its compiled programs are kept), so the server
goes on serving the requests that come next.
"""

import asyncio
import logging
import queue
import threading
import time

import jax
import numpy as np

from ._errors import APIError


_log = logging.getLogger("eqrope.serving")


class Ticket:
    """One engine request as the HTTP side sees it: what to submit, and where its events go.

    The worker posts `(tag, item)` pairs into `queue` on `loop`: an `Event`, or an
    `APIError` if the request could not run. `constraint`: its structured output's
    `Automaton`, or `None`.
    """

    def __init__(self, loop, queue_: asyncio.Queue, tag, prompt, config, seed: int, constraint=None):
        self.loop, self.queue, self.tag = loop, queue_, tag
        self.prompt, self.config, self.seed, self.constraint = prompt, config, seed, constraint
        self.samples = config.num_samples or 1
        self.ended = 0  # samples whose last event was posted
        self.request_id: int | None = None

    def post(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (self.tag, item))


class Worker:
    """Owns an `eqrope.Engine` on a thread of its own.

    **Arguments:**

    - `make_engine`: builds the engine (again, after a failed step).
    - `on_step`: called on this thread after every step with the engine's `EngineStats`
      and the step's events (the server's metrics).
    """

    def __init__(self, make_engine, on_step=None):
        self.make_engine, self.on_step = make_engine, on_step
        self.engine = make_engine()
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.tickets: dict[int, Ticket] = {}
        self.thread = threading.Thread(target=self._run, name="eqrope-engine", daemon=True)
        self.steps = 0
        self.failures = 0
        self._stopping = False

    # -- called from the asyncio side --------------------------------------------------

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self.inbox.put(("stop",))
        self.thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def submit(self, ticket: Ticket) -> None:
        self.inbox.put(("submit", ticket))

    def cancel(self, ticket: Ticket, sample: int | None = None) -> None:
        self.inbox.put(("cancel", ticket, sample))

    async def call(self, fn, *args):
        """Run `fn(*args)` on the engine's thread between steps; await its result."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.inbox.put(("call", fn, args, loop, future))
        return await future

    # -- the thread --------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            try:
                command = self.inbox.get(block=not self.engine.has_work())
            except queue.Empty:
                command = None
            while command is not None:
                try:
                    self._handle(command)
                except Exception as e:  # noqa: BLE001 (the thread must outlive any request)
                    _log.exception("the engine's thread failed on a %s command", command[0])
                    if command[0] == "submit":
                        command[1].post(APIError(500, f"{type(e).__name__}: {e}", type="server_error"))
                try:
                    command = self.inbox.get_nowait()
                except queue.Empty:
                    command = None
            if self.engine.has_work() and not self._stopping:
                self._step()

    def _handle(self, command) -> None:
        kind = command[0]
        if kind == "stop":
            self._stopping = True
        elif kind == "submit":
            self._submit(command[1])
        elif kind == "cancel":
            _, ticket, sample = command
            if ticket.request_id is not None and self.tickets.get(ticket.request_id) is ticket:
                try:
                    self.engine.cancel(ticket.request_id, sample)
                except (KeyError, ValueError):  # it ended on its own meanwhile
                    pass
        elif kind == "call":
            _, fn, args, loop, future = command
            try:
                result, error = fn(*args), None
            except Exception as e:  # noqa: BLE001 (handed to the awaiting request)
                result, error = None, e
            loop.call_soon_threadsafe(_settle, future, result, error)

    def _submit(self, ticket: Ticket) -> None:
        try:
            key = seed_key(ticket.seed)
            ticket.request_id = self.engine.submit(ticket.prompt, ticket.config, key=key, constraint=ticket.constraint)
        except (ValueError, TypeError) as e:
            ticket.post(APIError(400, str(e), param=None))
            return
        except RuntimeError as e:  # the engine's waiting queue is full
            ticket.post(APIError(503, str(e), type="server_error", code="server_overloaded", headers={"Retry-After": "1"}))
            return
        self.tickets[ticket.request_id] = ticket

    def _step(self) -> None:
        try:
            events = self.engine.step()
        except Exception as e:  # noqa: BLE001 (a fault inside the engine: fail what ran)
            _log.exception("an engine step failed; failing %d requests and rebuilding the engine", len(self.tickets))
            self.failures += 1
            error = APIError(500, f"The engine failed while running this request: {type(e).__name__}: {e}",
                             type="server_error", code="engine_error")  # fmt: skip
            for ticket in self.tickets.values():
                ticket.post(error)
            self.tickets.clear()
            self.engine = self.make_engine()
            return
        self.steps += 1
        for event in events:
            ticket = self.tickets.get(event.request_id)
            if ticket is None:
                continue
            ticket.post(event)
            if event.finished:
                ticket.ended += 1
                if ticket.ended == ticket.samples:
                    del self.tickets[event.request_id]
        if self.on_step is not None:
            try:
                self.on_step(self.engine.stats, events, time.perf_counter())
            except Exception:  # noqa: BLE001 (metrics must not stop the engine)
                _log.exception("recording the step's metrics failed")


def seed_key(seed: int):
    """The key of an OpenAI `seed` (any int64): `jax.random.key(seed)` for seeds in
    `[0, 2**32)`, and beyond, the seed's high 32 bits folded into the key of its low
    ones, so that no two seeds share a key (JAX's 32-bit mode drops the high bits:
    `jax.random.key(2**32)` is `jax.random.key(0)` there)."""
    bits = seed % 2**64
    key = jax.random.key(np.uint32(bits & 0xFFFFFFFF))
    return key if bits < 2**32 else jax.random.fold_in(key, np.uint32(bits >> 32))


def _settle(future: asyncio.Future, result, error) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
