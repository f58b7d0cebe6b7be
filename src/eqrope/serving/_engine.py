"""`eqrope.Engine`: many requests at once, continuous batching over a paged key/value cache.

The loop (`step`) is nano-vllm's `LLMEngine.step` and Levanter's `InferenceEngine` in one
page: admit waiting requests (`_scheduler.py`), run one prefill call of a few prompt
pieces, put prompts that are done into slots (their first token), run one compiled chunk
of decode steps over the running slots, and report what each sample added. Finished
samples free their slot and pages between chunks, and the next waiting request takes them.
With a `mesh`, the slots and the pool are split over the data shards (`_mesh_layout.py`).
"""

import itertools

import jax
import numpy as np

from .._checks import check_int
from .._custom_types import IntLike
from ..generation import GenerationConfig
from ..generation._sampling import stack_rows
from ._constraints import constraint_blocks
from ._mesh_layout import by_shard, check_pages, data_shards, decode_slots, place_rows
from ._pages import PagePool, page_hashes
from ._paged_cache import pool_pages
from ._offline import run_to_end
from ._runner import Runner
from ._scheduler import Scheduler
from ._sequence import EngineStats, Event, Request, Sequence, finish_reason
from ._settings import (
    Capacities, check_buckets, idle_sampling, powers as _powers, request_config, request_sampling, sample_keys,
)  # fmt: skip


class Engine:
    """Continuous batching of many requests over one model, in process.

    **Arguments:**

    - `model`: an [`eqrope.RotaryDecoder`][] (either layout; the engine decodes its
      unstacked form).
    - `slots`: how many samples decode at once.
    - `page_size`: rows (positions) per page of the key/value pool.
    - `pages`: pages in the pool, the null page (one per data shard) included. `None`
      sizes it from `kv_memory`, or, without it, for every slot at `max_len` (no request
      ever waits for pages while a slot is free): `slots * max_len / page_size + 1` (a
      null page per data shard on a mesh).
    - `kv_memory`: a budget in bytes for the pool's keys and values (with `pages=None`).
    - `max_len`: the most positions of one sample (prompt plus new tokens); `None`: the
      model's. A multiple of `prefill_chunk`.
    - `prefill_chunk`: the longest prompt piece one prefill call computes per prompt; a
      long prompt is prefilled in pieces of this size, and a running decode waits at most
      one prefill call. A shorter last piece takes the smallest power of two from 16 (or
      `prefill_chunk`, if smaller) that holds it: one program per size.
    - `prefill_rows`: the most prompts one prefill call holds.
    - `decode_steps`: the most decode steps of one compiled chunk; a chunk ends early
      when a sample finishes while a request waits for its slot.
    - `decode_buckets`: the slot counts the decode program is compiled for (default:
      powers of two up to `slots`); a chunk runs the smallest that holds the running
      samples. On a mesh: slot counts of one data shard (up to `slots / D`).
    - `max_waiting`: the most requests waiting for admission; `submit` refuses more.
    - `max_eos_ids`, `max_bad_ids`, `max_stop`, `max_stop_len`: the most ids one request
      may carry (shapes of the programs).
    - `max_stop_strings`, `max_stop_string_bytes`, `max_stop_string_tokens`: the most
      stop strings ([`eqrope.StopStrings`][]) one request may carry, the bytes of the
      longest, and the token ids that can take part in a match; 0 stop strings (the
      default) refuses them and costs nothing (docs/serving.md).
    - `check_finite`: stop a sample whose logits hold a NaN or an infinity
      (`finish_reason` `"nonfinite"`).
    - `constraint_capacity`: `(states, exceptions)` of the table that holds the running
      requests' structured-output automata (`submit(..., constraint=)`), FREE and one
      spare state per automaton included; `None` (the default) refuses constraints and
      costs nothing. A request waits while the table cannot hold its automaton.
    - `mesh`, `rules`: a device mesh ([`eqrope.make_mesh`][]) and its
      [`eqrope.ShardingRules`][] (`None`: the defaults): the weights over the `model`
      axis, the slots and the pool's pages split over the `data` axis in `D` shards
      (`slots` and `pages` multiples of `D`), each request on one shard (docs/serving.md).
    """

    def __init__(
        self,
        model,
        *,
        slots: IntLike,
        page_size: IntLike = 16,
        pages: IntLike | None = None,
        kv_memory: IntLike | None = None,
        max_len: IntLike | None = None,
        prefill_chunk: IntLike = 64,
        prefill_rows: IntLike = 4,
        decode_steps: IntLike = 16,
        decode_buckets: tuple[IntLike, ...] | list[IntLike] | None = None,
        max_waiting: IntLike = 1024,
        max_eos_ids: IntLike = 8,
        max_bad_ids: IntLike = 64,
        max_stop: IntLike = 8,
        max_stop_len: IntLike = 8,
        max_stop_strings: IntLike = 0,
        max_stop_string_bytes: IntLike = 16,
        max_stop_string_tokens: IntLike = 256,
        check_finite: bool = True,
        constraint_capacity: tuple[IntLike, IntLike] | None = None,
        mesh=None,
        rules=None,
    ):
        if not hasattr(model, "unstacked") or not hasattr(model, "config"):
            raise TypeError(f"model must be an eqrope.RotaryDecoder, got {type(model).__name__}.")
        if model.fixed_rows is not None:
            raise ValueError("the engine runs one model for every request; merge per-row adapters first.")
        config = model.config
        self.slots = check_int(slots, "slots", minimum=1)
        self.page_size = check_int(page_size, "page_size", minimum=1)
        self.prefill_chunk = check_int(prefill_chunk, "prefill_chunk", minimum=1)
        self.max_len = config.max_len if max_len is None else check_int(max_len, "max_len", minimum=1)
        if self.max_len > config.max_len:
            raise ValueError(f"max_len={self.max_len}, but the model holds {config.max_len} positions.")
        if self.prefill_chunk % self.page_size or self.max_len % self.prefill_chunk:
            raise ValueError(
                f"prefill_chunk={prefill_chunk} must be a multiple of page_size={page_size}, "
                f"and max_len={self.max_len} a multiple of prefill_chunk."
            )
        self.prefill_rows = check_int(prefill_rows, "prefill_rows", minimum=1)
        self.decode_steps = check_int(decode_steps, "decode_steps", minimum=1)
        self.max_waiting = check_int(max_waiting, "max_waiting", minimum=1)
        self.check_finite = np.bool_(check_finite)
        self.caps = Capacities(
            max_eos_ids, max_bad_ids, max_stop, max_stop_len, max_stop_strings, max_stop_string_bytes,
            max_stop_string_tokens,
        )  # fmt: skip
        self.max_pages = self.max_len // self.page_size
        self.shards = data_shards(mesh, rules, self.slots)
        if pages is None:  # `kv_memory` is a budget: the most pages it holds that the shards split
            budget = None if kv_memory is None else check_int(kv_memory, "kv_memory", minimum=1)
            pages = self.slots * self.max_pages + self.shards if budget is None else pool_pages(budget, config, self.page_size)
            pages -= pages % self.shards
        per_shard = check_pages(pages := check_int(pages, "pages", minimum=2), self.shards)
        self.vocab = config.vocab_size
        self.constraints = constraint_blocks(constraint_capacity, self.vocab, mesh)
        self.runner = Runner(
            model, slots=self.slots, pages=pages, page_size=self.page_size, max_len=self.max_len,
            chunk=self.prefill_chunk, mesh=mesh, rules=rules, shards=self.shards, constraints=self.constraints,
        )  # fmt: skip
        pools = [PagePool(per_shard, self.page_size, first=d * per_shard) for d in range(self.shards)]
        self.scheduler = Scheduler(pools, self.slots, self.prefill_chunk, self.max_waiting)
        self.prefill_sizes = _powers(min(16, self.prefill_chunk), self.prefill_chunk)
        self.prefill_buckets = _powers(1, self.prefill_rows)
        self.decode_buckets = check_buckets(decode_buckets, self.slots // self.shards)
        self._idle = idle_sampling(self.vocab, self.caps)
        self._sampling = [self._idle] * self.slots
        self._keys = np.zeros((self.slots, 2), np.uint32)
        self._max_new = np.zeros((self.slots,), np.int32)
        self._ids = itertools.count()
        self._requests: dict[int, Request] = {}  # waiting, prefilling or running
        self._kept: dict[int, Request | None] = {}  # finished requests `generate` waits for
        self._pending: list[Event] = []
        self._computed = 0

    # -- the online calls --------------------------------------------------------------

    def submit(
        self, prompt, config: GenerationConfig | None = None, *, key=None, constraint=None, think_end=None, **settings
    ) -> int:
        """Queue one 1-D prompt with its settings and key. **Returns:** its request id.

        The settings are `config`'s (a [`eqrope.GenerationConfig`][], `max_new` or
        `max_total` required) with `settings` (its fields as keywords, as `generate` takes
        them) over it. `key` samples, as `generate(prompt, key=key)` would; `None`:
        `jax.random.key(request_id)`. `constraint`: an `Automaton` (`eqrope.Regex(...)
        .compile(tokenizer, vocab=)`) every sample's text must match, as
        `generate(..., constraint=)` runs it (needs `constraint_capacity`); `think_end`,
        as `generate`'s: the constraint starts after these ids (a reasoning model's text).

        Refuses, by a `ValueError` naming the fix, a prompt that cannot fit `max_len`,
        settings past the engine's capacities, more samples than slots, or a request
        larger than the whole pool; by a `TypeError` an unknown setting; and by a
        `RuntimeError` a full waiting queue (nothing is dropped: the caller keeps it).
        """
        prompt, config = request_config(prompt, config, settings, self.vocab, self.max_len)
        if self.constraints is None and (constraint is not None or think_end is not None):
            raise ValueError("constraint= needs an Engine built with constraint_capacity=(states, exceptions).")
        constraint = None if self.constraints is None else self.constraints.request(constraint, think_end)
        sampling = request_sampling(config, self.vocab, self.caps)
        samples = config.num_samples
        if (samples or 1) > self.slots // self.shards:  # a request's samples share a data shard
            raise ValueError(f"num_samples={samples} is more than the {self.slots // self.shards} slots of a data shard.")
        if len(self.scheduler.waiting) >= self.max_waiting:
            raise RuntimeError(
                f"the engine's waiting queue is full ({self.max_waiting} requests); step() until "
                "some are admitted, or build the Engine with a larger max_waiting."
            )
        request_id = next(self._ids)
        key = jax.random.key(request_id) if key is None else key
        request = Request(
            request_id, prompt, config, sampling, config.max_new, sample_keys(key, samples, self.slots // self.shards),
            page_hashes(prompt.tolist(), self.page_size), constraint=constraint,
        )  # fmt: skip
        worst, room = self.scheduler.worst_case(request), self.scheduler.pools[0].n_pages - 1
        if worst > room:
            raise ValueError(
                f"the request needs up to {worst} pages of {self.page_size} positions, but the "
                f"pool{' of a data shard' if self.shards > 1 else ''} holds {room}; lower "
                "max_new or num_samples, or build the Engine with more pages."
            )
        self._requests[request_id] = request
        self.scheduler.waiting.append(request)
        return request_id

    def cancel(self, request_id: int, sample: int | None = None) -> None:
        """End a request now, or only its sample `sample` (a server whose stop string
        matched in one sample's text): its slots and pages are freed at once, and the next
        `step` reports each sample it ended with `finish_reason` `"cancelled"`.

        Raises `KeyError` for a request that has ended or never was, and `ValueError` for
        a `sample` the request does not have or one that has not started (a request that
        is waiting or prefilling is cancelled whole).
        """
        request = self._requests.get(request_id)
        if request is None:
            raise KeyError(f"no request {request_id} is waiting or running.")
        if sample is not None:
            if not request.sequences or not 0 <= sample < request.samples:
                raise ValueError(
                    f"request {request_id} has no running sample {sample}: it has "
                    f"{request.samples} samples and {len(request.sequences)} started; cancel "
                    "the whole request (sample=None) before its samples start."
                )
            self._cancel(request.sequences[sample])
            if request.finished:
                self._finished(request)
            return
        del self._requests[request_id]
        self.scheduler.drop(request)
        if not request.sequences:  # waiting or prefilling: its samples end before a token
            request.sequences = [Sequence(request, i, -1, [], len(request.prompt)) for i in range(request.samples)]
        for sequence in request.sequences:
            self._cancel(sequence)
        self._finished(request)

    def _cancel(self, sequence: Sequence) -> None:
        if sequence.finish_reason is None:
            sequence.finish_reason = "cancelled"
            if sequence.slot >= 0:
                self.scheduler.finish(sequence)
            self._pending.append(sequence.event())

    def step(self) -> list[Event]:
        """Admit, prefill, start and decode once. **Returns:** every event since the last call."""
        events, self._pending = self._pending, []
        self.scheduler.admit(None if self.constraints is None else self.constraints.hold)
        started = self._prefill()
        while self.scheduler.prefilling and not self.scheduler.running():
            started += self._prefill()
        if self.scheduler.running():
            # While prompts wait for their pieces, or a first token was just drawn, the
            # chunk is one step: a running request waits at most one prefill call, and a
            # new one's first token is reported without waiting for a whole chunk.
            short = bool(self.scheduler.prefilling or started)
            return events + started + self._decode(1 if short else self.decode_steps)
        return events + started

    @property
    def stats(self) -> EngineStats:
        return self.scheduler.stats(self.runner.pool.bytes_per_page(), self._computed)

    def warmup(self) -> int:
        """Compile every program the engine can run (each prefill size and row count,
        each decode bucket, the start and the page copy, and the keys' derivations) on an
        idle engine, writing nothing any request reads. **Returns:** how many programs ran."""
        if self.has_work():
            raise RuntimeError("warm up an idle engine, before the first submit.")
        for samples in (None, *range(2, self.slots // self.shards + 1)):  # one split by default
            sample_keys(jax.random.key(0), samples, self.slots // self.shards)
        shapes = [(self.shards * rows, size) for rows in self.prefill_buckets for size in self.prefill_sizes]
        decode = [decode_slots(self.scheduler.slots, [[]] * self.shards, n) for n in self.decode_buckets]
        return self.runner.warmup(shapes, decode, self._idle, self.check_finite)

    def has_work(self) -> bool:
        """Whether a request is waiting, prefilling or running, or an event is unreported."""
        s = self.scheduler
        return bool(s.waiting or s.prefilling or s.running() or self._pending)

    # -- the offline call --------------------------------------------------------------

    def generate(self, prompts, configs=None, *, keys=None, constraints=None) -> list:
        """Run every prompt to its end, like vLLM's `LLM.generate`.

        **Arguments:** `prompts`, a list of 1-D id arrays; `configs`, one
        `GenerationConfig` for all or a list with one per prompt; `keys`, one PRNG key per
        prompt, or `None`: prompt `i` samples with `jax.random.key(i)`; `constraints`,
        one `Automaton` (or `None`) per prompt, or `None` (see `submit`).

        **Returns:** one entry per prompt, in order: a `Completion`, or a list of
        `num_samples` of them.
        """
        return run_to_end(self, prompts, configs, keys, constraints)

    # -- the device side ---------------------------------------------------------------

    def _prefill(self) -> list[Event]:
        """One prefill call: the next pieces of up to `prefill_rows` prompts of one size."""
        scheduler = self.scheduler
        if not scheduler.prefilling:
            return []
        size = self._piece(scheduler.prefilling[0])
        groups = by_shard([r for r in scheduler.prefilling if self._piece(r) == size], self.shards, lambda r: r.shard)
        n, placed = place_rows([group[: self.prefill_rows] for group in groups], self.prefill_buckets)
        rows = n * self.shards
        ids = np.zeros((rows, size), np.int32)
        tables = np.zeros((rows, self.max_pages), np.int32)
        starts, last, live = np.zeros(rows, np.int32), np.zeros(rows, np.int32), np.zeros(rows, bool)
        for r, request in placed:
            start, length = request.prefilled, len(request.prompt)
            piece = request.prompt[start : start + size]
            ids[r, : len(piece)] = piece
            scheduler.grow(request, min(start + size, length), request)
            tables[r, : len(request.pages)] = request.pages
            starts[r], last[r], live[r] = start, min(length - 1 - start, size - 1), True
            self._computed += len(piece)
        logits = self.runner.prefill(tables, ids, starts, last, live)
        events = []
        for r, request in placed:
            request.prefilled = min(request.prefilled + size, len(request.prompt))
            if request.prefilled == len(request.prompt):
                scheduler.prefilled(request)
                events += self._start(request, logits[r])
        return events

    def _piece(self, request: Request) -> int:
        left = len(request.prompt) - request.prefilled
        return next((s for s in self.prefill_sizes if s >= left), self.prefill_chunk)

    def _start(self, request: Request, logits) -> list[Event]:
        sequences = self.scheduler.start(request)
        if request.copies:
            self.runner.copy(request.copies)
        firsts = []
        for sequence in sequences:
            slot = sequence.slot
            self._sampling[slot] = request.sampling
            self._keys[slot] = request.keys[sequence.sample]
            self._max_new[slot] = request.max_new
            state = () if self.constraints is None else (self.constraints.start(request.id),)
            firsts.append(self.runner.start(
                slot, logits, request.prompt, request.sampling, self._keys[slot], request.max_new,
                self.check_finite, *state,
            ))  # fmt: skip
        events = []
        for sequence, (token, logprob, done, nonfinite) in zip(sequences, jax.device_get(firsts)):
            tokens, logprobs = ([], []) if nonfinite else ([token], [logprob])
            events += self._read(sequence, tokens, logprobs, done, nonfinite)
        return events

    def _decode(self, steps: int) -> list[Event]:
        scheduler = self.scheduler
        running = scheduler.running()
        for sequence in running:
            rows = min(sequence.pos - 1 + steps, sequence.request.end - 1)
            scheduler.grow(sequence, rows, sequence.request)
        groups = by_shard(running, self.shards, lambda s: s.request.shard)
        bucket, placed = place_rows(groups, self.decode_buckets)
        rows = decode_slots(scheduler.slots, groups, bucket)
        tables = np.zeros((len(rows), self.max_pages), np.int32)
        live = np.zeros(len(rows), bool)
        for r, sequence in placed:
            tables[r, : len(sequence.pages)], live[r] = sequence.pages, True
        # A waiting request takes the first slot that frees: end the chunk there (each
        # shard's loop ends at its first).
        exit_after = 1 if scheduler.waiting else bucket + 1
        sampling = stack_rows([self._sampling[i] if live[r] else self._idle for r, i in enumerate(rows)])
        view = self.runner.decode(
            rows, live, tables, sampling, self._keys[rows], self._max_new[rows], steps, exit_after,
            self.check_finite,
        )  # fmt: skip
        events = []
        for r, sequence in placed:
            new = slice(sequence.pos, int(view["pos"][r]))
            events += self._read(
                sequence, view["tokens"][r, new], view["logprobs"][r, new], view["done"][r],
                view["nonfinite"][r],
            )  # fmt: skip
            if sequence.finish_reason is None:
                scheduler.trim(sequence)
        return events

    def _read(self, sequence, tokens, logprobs, done, nonfinite) -> list[Event]:
        """Take a sample's new tokens; end it if the device did. **Returns:** its event."""
        sequence.take(list(tokens), list(logprobs))
        if done:
            sequence.finish_reason = finish_reason(sequence, bool(nonfinite))
            self.scheduler.finish(sequence)
            if sequence.request.finished:
                self._finished(sequence.request)
        return [sequence.event()] if (sequence.sent < len(sequence.tokens) or done) else []

    def _finished(self, request: Request) -> None:
        """A request whose samples have all ended leaves the engine (kept for `generate`)."""
        self._requests.pop(request.id, None)
        if self.constraints is not None:
            self.constraints.release(request.id)
        if request.id in self._kept:
            self._kept[request.id] = request

