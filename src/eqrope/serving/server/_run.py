"""One HTTP request's run: a `Job`'s prompts as engine requests, each sample's tokens as
text, and the log-probabilities asked for.

Each prompt is one engine request (its `n` samples share one prefill); each sample is a
`Choice` (OpenAI's `choices[index]`, `index = prompt * n + sample`). Tokens arrive as
engine `Event`s; each is added to its sample's `TextStream`, which matches the stop
strings on the text: a match ends the sample there and cancels it in the engine. An EOS
(or a `stop_token_ids` id) counts as a completion token but adds no text, as in vLLM.
Log-probabilities are the raw model's (vLLM's default), computed on the engine's thread
by `token_logprobs` over the prompt and the tokens kept.
"""

import asyncio
import dataclasses
import functools
import secrets
import time

import numpy as np

from ...generation import GenerationConfig
from ._errors import APIError, bad_field
from ._logprobs import TokenLogprobs, token_logprobs
from ._requests import Job
from ._text import TextStream
from ._worker import Ticket


# The engine's finish reasons as OpenAI's (vLLM's "abort" for a cancelled sample).
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "abort", "nonfinite": "error"}


@dataclasses.dataclass(eq=False)
class Choice:
    """One sample: its text, the tokens it keeps (through a stop), and how it ended."""

    index: int
    prompt: int
    sample: int
    text: TextStream
    tokens: list = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    stopped: bool = False  # a stop string matched: later tokens are dropped
    ended: bool = False  # the engine sent its last event (or it never ran)
    logprobs_sent: int = 0  # tokens whose log-probabilities a stream has sent
    last_token_at: float | None = None


class JobRun:
    """Run `job` on `server`'s engine. `events()` yields after each change; `choices`
    hold the state; `cancel()` ends whatever still runs."""

    def __init__(self, job: Job, server, arrival: float, constraint=None):
        self.job, self.server, self.arrival, self.constraint = job, server, arrival, constraint
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tickets: list[Ticket | None] = []
        self.first_token: list[bool] = [False] * len(job.prompts)
        self.choices = [
            Choice(i * job.n + s, i, s, TextStream(server.tokenizer, list(p), job.stop, min_tokens=job.settings["min_new"]))
            for i, p in enumerate(job.prompts)
            for s in range(job.n)
        ]  # fmt: skip
        self.configs = []
        for i, prompt in enumerate(job.prompts):
            try:
                self.configs.append(GenerationConfig(
                    max_new=job.max_tokens[i], num_samples=job.n if job.n > 1 else None, **job.settings
                ))  # fmt: skip
            except (TypeError, ValueError) as e:
                raise bad_field(None, str(e)) from None

    @property
    def samples(self) -> int:
        return len(self.choices)

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        seed = self.job.seed if self.job.seed is not None else secrets.randbits(63)
        for i, prompt in enumerate(self.job.prompts):
            if self.job.max_tokens[i] == 0:  # echo only: nothing to generate
                self.tickets.append(None)
                for choice in self._of(i):
                    choice.ended, choice.finish_reason = True, "length"
                continue
            ticket = Ticket(loop, self.queue, i, np.asarray(prompt, np.int32), self.configs[i], seed, self.constraint)
            self.tickets.append(ticket)
            self.server.worker.submit(ticket)
        self.server.metrics.prompt_tokens.labels(**self.server.metrics.labels).inc(sum(map(len, self.job.prompts)))

    async def events(self):
        """Take the engine's events until every sample has ended; yield after each."""
        while not all(c.ended for c in self.choices):
            tag, item = await self.queue.get()
            if isinstance(item, APIError):
                raise item
            self._take(tag, item)
            yield

    def cancel(self) -> None:
        """End every sample still running (the client left, or the request failed)."""
        for i, ticket in enumerate(self.tickets):
            if ticket is not None and not all(c.ended for c in self._of(i)):
                self.server.worker.cancel(ticket)
        for choice in self.choices:
            if not choice.ended:
                choice.ended, choice.finish_reason = True, "abort"
                self.server.metrics.finished("abort")

    def _of(self, prompt: int) -> list[Choice]:
        n = self.job.n
        return self.choices[prompt * n : (prompt + 1) * n]

    def _take(self, prompt: int, event) -> None:
        choice = self.choices[prompt * self.job.n + event.sample]
        now = time.perf_counter()
        tokens = [int(t) for t in event.tokens]
        metrics = self.server.metrics
        if tokens:
            if not self.first_token[prompt]:
                self.first_token[prompt] = True
                metrics.ttft.labels(**metrics.labels).observe(now - self.arrival)
            if choice.last_token_at is not None:
                for _ in tokens:
                    metrics.itl.labels(**metrics.labels).observe((now - choice.last_token_at) / len(tokens))
            choice.last_token_at = now
        for k, token in enumerate(tokens):
            if choice.stopped:
                break
            choice.tokens.append(token)
            if event.finished and event.finish_reason == "eos" and k == len(tokens) - 1:
                choice.stop_reason = token  # an EOS or stop token id: counted, not shown
            elif choice.text.push(token):
                choice.stopped, choice.finish_reason = True, "stop"
                choice.stop_reason = choice.text.stopped
                if not event.finished:
                    self.server.worker.cancel(self.tickets[prompt], event.sample)
        if event.finished:
            choice.ended = True
            if choice.finish_reason is None:
                choice.finish_reason = FINISH[event.finish_reason]
            metrics.finished(choice.finish_reason)
            if all(c.ended for c in self._of(prompt)):
                metrics.e2e.labels(**metrics.labels).observe(now - self.arrival)

    # -- log-probabilities -------------------------------------------------------------

    async def logprobs(self, choice: Choice, start: int, end: int) -> TokenLogprobs:
        """The raw model's log-probabilities of positions `start .. end - 1` of
        `choice`'s prompt and kept tokens, with the top `job.logprobs`."""
        prompt = list(self.job.prompts[choice.prompt])
        ids = prompt + choice.tokens[: end - len(prompt)]
        limit = self.server.limits.max_logprobs
        score = functools.partial(token_logprobs, max_k=limit)
        return await self.server.worker.call(score, self.server.model, np.asarray(ids, np.int32), start, self.job.logprobs)
