"""One request's host-side state, each of its samples' state, and what the engine hands back.

A `Request` is what `Engine.submit` takes in: a prompt, its settings and its key. Its
prompt is prefilled once; then each of its `num_samples` samples (one without
`num_samples`) is a `Sequence` in a slot of its own, holding its pages. `Completion` and
`Event` are the engine's results, offline and online; `EngineStats` its state.
"""

import dataclasses
import time

import numpy as np

from ..generation import GenerationConfig
from ..generation._sampling import Sampling
from ..generation._finish import finish_reason as host_finish_reason


FINISH_REASONS = ("length", "eos", "stop", "cancelled", "nonfinite")


@dataclasses.dataclass(frozen=True)
class Completion:
    """One sample's result.

    - `tokens`: the new tokens only, int32, up to and including an EOS id or the last
      token of a stop sequence or a stop string.
    - `logprobs`: each token's log-probability under the distribution it was drawn from,
      after every processor (as `generate(..., return_logprobs=True).logprobs`), float32.
    - `finish_reason`: `"length"` (`max_new` tokens), `"eos"`, `"stop"`, `"cancelled"`, or
      `"nonfinite"` (the logits held a NaN or an infinity: the sample stopped there).
    """

    tokens: np.ndarray
    logprobs: np.ndarray
    finish_reason: str

    def __repr__(self) -> str:
        return f"Completion(tokens={self.tokens.tolist()}, finish_reason={self.finish_reason!r})"


@dataclasses.dataclass(frozen=True)
class Event:
    """What `Engine.step` reports of one sample: its `tokens` (and their `logprobs`) new
    since its last event, and whether it has `finished`, with its `finish_reason`.
    `sample` is the sample's index (0 without `num_samples`)."""

    request_id: int
    sample: int
    tokens: np.ndarray
    logprobs: np.ndarray
    finished: bool
    finish_reason: str | None


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """The engine's state between steps.

    - `pages_total`: pages of the pool (the null page not counted); `pages_free`: those
      `allocate` can hand out (cached prefixes nobody holds included); `pages_used`: held
      by a request; `pages_cached`: holding a registered prompt prefix.
    - `running`: samples in slots; `prefilling`: admitted prompts not yet in slots;
      `waiting`: requests not yet admitted.
    - `tokens_held`: positions whose keys and values the running samples and prefilling
      prompts hold; `kv_bytes_held`: the bytes of the pages held; `kv_bytes_per_token`.
    - `prefix_hit_tokens`: prompt positions taken from the cache instead of computed, in
      all; `prompt_tokens_computed`: prompt positions the prefill computed, in all.
    """

    pages_total: int
    pages_free: int
    pages_used: int
    pages_cached: int
    running: int
    prefilling: int
    waiting: int
    tokens_held: int
    kv_bytes_held: int
    kv_bytes_per_token: int
    prefix_hit_tokens: int
    prompt_tokens_computed: int


@dataclasses.dataclass(eq=False)
class Request:
    """A submitted prompt: waiting, then prefilling (holding its prompt's pages), then
    running as its `sequences`, one per sample."""

    id: int
    prompt: np.ndarray
    config: GenerationConfig
    sampling: Sampling
    max_new: int
    keys: list
    hashes: list
    pages: list = dataclasses.field(default_factory=list)
    prefilled: int = 0
    budget: int = 0
    hit_rows: int = 0
    shard: int = 0  # the data shard whose slots and pages it holds (`Scheduler._admit`)
    sequences: list = dataclasses.field(default_factory=list)
    copies: list = dataclasses.field(default_factory=list)  # (source, target) pages to copy at start
    submitted: float = dataclasses.field(default_factory=time.perf_counter)
    constraint: object = None  # an `Automaton` its samples' text must match (`_constraints.py`)

    @property
    def samples(self) -> int:
        return len(self.keys)

    @property
    def end(self) -> int:
        """The most positions a sample can reach: prompt plus `max_new`."""
        return len(self.prompt) + self.max_new

    @property
    def finished(self) -> bool:
        return bool(self.sequences) and all(s.finish_reason is not None for s in self.sequences)


@dataclasses.dataclass(eq=False)
class Sequence:
    """One sample in a slot: its pages (the page table's row), the position of its next
    token, the tokens generated so far, and how many of them events have reported."""

    request: Request
    sample: int
    slot: int
    pages: list
    pos: int
    tokens: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    sent: int = 0
    finish_reason: str | None = None
    first_token_at: float | None = None

    def take(self, tokens, logprobs) -> None:
        """Add the tokens the device committed since the last read."""
        if tokens and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.tokens.extend(int(t) for t in tokens)
        self.logprobs.extend(float(x) for x in logprobs)
        self.pos += len(tokens)

    def event(self) -> Event:
        new = slice(self.sent, len(self.tokens))
        self.sent = len(self.tokens)
        return Event(
            self.request.id, self.sample, np.asarray(self.tokens[new], np.int32),
            np.asarray(self.logprobs[new], np.float32), self.finish_reason is not None,
            self.finish_reason,
        )  # fmt: skip

    def completion(self) -> Completion:
        return Completion(
            np.asarray(self.tokens, np.int32), np.asarray(self.logprobs, np.float32), self.finish_reason
        )


def finish_reason(sequence: Sequence, nonfinite: bool) -> str:
    """Why a sample the device marked done ended, read from its text as the device's
    `commit` decided it (`eqrope.generation._finish`), or `"nonfinite"`."""
    if nonfinite:
        return "nonfinite"
    request, sampling = sequence.request, sequence.request.sampling
    return host_finish_reason(
        request.prompt.tolist(), sequence.tokens, np.asarray(sampling.eos).tolist(),
        int(sampling.min_new), sampling.stop, sampling.stop_text,
    )  # fmt: skip
