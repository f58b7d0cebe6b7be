"""Who runs: the waiting queue, admission into slots, and every page a request holds.

Plain Python, no JAX (vLLM's `Scheduler`, nano-vllm's `scheduler.py`). A request is
admitted only when it has a slot for each sample and the pool can hold its worst case
(prompt plus `max_new` for every sample): pages are then allocated as positions advance,
a decode chunk's lookahead at a time, and an allocation can never fail, so nothing is
preempted and a request's memory follows its tokens. `Scheduler.reserved` is what the
admitted requests may still allocate; `PagePool.free >= reserved` always.

On a mesh the slots and the pool are split over the data shards (`_mesh_layout.py`): each
shard has its own `PagePool` and its block of slots, and a request is admitted to the
shard with the most free slots that can hold it, keeping the queue's order. Everything
here is then per shard (`request.shard`); one shard is the one-device engine.

Prefix reuse: a prompt's full pages are found by their chained hashes (`PagePool.match`)
and shared. The hit is rounded down to a multiple of the prefill piece, so that a request
runs the same prefill pieces at the same offsets whether its prefix was cached or not:
a cache hit cannot change a result.
"""

import collections
import math

from ._pages import PagePool
from ._sequence import EngineStats, Request, Sequence


class Scheduler:
    def __init__(self, pools: list[PagePool], slots: int, piece: int, max_waiting: int):
        self.pools, self.piece, self.max_waiting = pools, piece, max_waiting
        self.per_shard = slots // len(pools)  # shard `d` holds slots `d * per_shard ..`
        self.waiting: collections.deque[Request] = collections.deque()
        self.prefilling: list[Request] = []
        self.slots: list[Sequence | None] = [None] * slots
        self.reserved_by = [0] * len(pools)
        self.hit_rows = 0

    @property
    def pool(self) -> PagePool:
        """The pool of a one-shard engine."""
        if len(self.pools) != 1:
            raise AttributeError("a sharded engine has one pool per data shard: read scheduler.pools.")
        return self.pools[0]

    @property
    def reserved(self) -> int:
        return sum(self.reserved_by)

    def _pool(self, holder) -> PagePool:
        return self.pools[getattr(holder, "request", holder).shard]

    # -- admission ---------------------------------------------------------------------

    def worst_case(self, request: Request) -> int:
        """The most pages `request` can ever hold: its shared full prompt pages once, and
        every sample's own pages up to its last position."""
        size = self.pools[0].page_size
        shared = len(request.prompt) // size
        return shared + request.samples * (math.ceil(request.end / size) - shared)

    def free_slots(self, shard: int) -> list[int]:
        """The free slots of `shard` that no prefilling request has claimed."""
        taken = sum(r.samples for r in self.prefilling if r.shard == shard)
        first = shard * self.per_shard
        free = [i for i in range(first, first + self.per_shard) if self.slots[i] is None]
        return free[taken:]

    def admit(self, hold=None) -> list[Request]:
        """Move waiting requests, in order, into prefilling while slots and pages allow,
        and `hold(request_id, constraint)`, if given, takes the request's constraint in
        the engine's table (it keeps it while it waits for slots or pages)."""
        admitted = []
        while self.waiting:
            request = self.waiting[0]
            if (hold is not None and not hold(request.id, request.constraint)) or not self._admit(request):
                break
            admitted.append(self.waiting.popleft())
        return admitted

    def _admit(self, request: Request) -> bool:
        room = lambda d: (-len(self.free_slots(d)), self.reserved_by[d] - self.pools[d].free, d)
        return any(self._admit_to(request, d) for d in sorted(range(len(self.pools)), key=room))

    def _admit_to(self, request: Request, shard: int) -> bool:
        if len(self.free_slots(shard)) < request.samples:
            return False
        pool = self.pools[shard]
        size, length = pool.page_size, len(request.prompt)
        hits = pool.match(request.hashes)
        # Hit rows: whole pieces, and at least the prompt's last token left to compute.
        rows = min(len(hits) * size, (length - 1) // self.piece * self.piece)
        hits = hits[: rows // size]
        idle_hits = sum(1 for page in hits if pool.refs(page) == 0)
        worst = self.worst_case(request)
        if pool.free - self.reserved_by[shard] < worst - len(hits) + idle_hits:
            return False
        for page in hits:
            pool.retain(page)
        request.pages, request.prefilled, request.hit_rows = list(hits), rows, rows
        request.budget, request.shard = worst - len(hits), shard
        self.reserved_by[shard] += request.budget
        self.hit_rows += rows
        self.prefilling.append(request)
        return True

    # -- pages -------------------------------------------------------------------------

    def allocate(self, request: Request) -> int:
        if request.budget <= 0:
            raise RuntimeError(f"request {request.id} is past its reserved pages (a bug).")
        request.budget -= 1
        self.reserved_by[request.shard] -= 1
        return self.pools[request.shard].allocate()

    def grow(self, holder, rows: int, request: Request) -> None:
        """`holder.pages` (a request's prompt, or a sample's) until they hold `rows` rows."""
        while len(holder.pages) * self.pools[0].page_size < rows:
            holder.pages.append(self.allocate(request))

    def trim(self, sequence: Sequence) -> None:
        """Give back the pages past `sequence`'s written rows (a decode chunk's lookahead
        that an early exit left unwritten), so that between chunks a sample holds at most
        one partly written page. Its reservation takes them back."""
        written, pool = sequence.pos - 1, self._pool(sequence)
        while len(sequence.pages) * pool.page_size - pool.page_size >= max(written, 1):
            pool.release(sequence.pages.pop())
            sequence.request.budget += 1
            self.reserved_by[sequence.request.shard] += 1

    def prefilled(self, request: Request) -> None:
        """After its prompt's last piece: register its full pages for later prompts."""
        for page, page_hash in zip(request.pages, request.hashes):
            self.pools[request.shard].register(page, page_hash)

    def start(self, request: Request) -> list[Sequence]:
        """Put every sample of a prefilled request in a slot. Sample 0 takes the prompt's
        pages; the others share its full pages and get their own copy of its partial last
        page. **Returns:** the samples; the copies to make are `(source, target)` pairs in
        `request.copies`."""
        self.prefilling.remove(request)
        pool = self.pools[request.shard]
        length, size = len(request.prompt), pool.page_size
        full = length // size
        slots = self.free_slots(request.shard)[: request.samples]
        for sample, slot in enumerate(slots):
            if sample == 0:
                pages = request.pages
            else:
                pages = list(request.pages[:full])
                for page in pages:
                    pool.retain(page)
                if len(request.pages) > full:
                    copy = self.allocate(request)
                    request.copies.append((request.pages[full], copy))
                    pages.append(copy)
            sequence = Sequence(request, sample, slot, pages, pos=length)
            self.slots[slot] = sequence
            request.sequences.append(sequence)
        request.pages = []
        return request.sequences

    def release(self, holder) -> None:
        """Give back `holder`'s pages, last first (a shared prefix is evicted last)."""
        pool = self._pool(holder)
        for page in reversed(holder.pages):
            pool.release(page)
        holder.pages = []

    def finish(self, sequence: Sequence) -> None:
        """A sample ended: its slot and pages are free; once every sample of its request
        has ended, what the request reserved and did not use is given back."""
        self.release(sequence)
        self.slots[sequence.slot] = None
        request = sequence.request
        if request.finished:
            self.reserved_by[request.shard] -= request.budget
            request.budget = 0

    def drop(self, request: Request) -> None:
        """Take a waiting or prefilling request out (cancelled), freeing what it holds."""
        if request in self.waiting:
            self.waiting.remove(request)
            return
        if request in self.prefilling:
            self.prefilling.remove(request)
            self.release(request)
            self.reserved_by[request.shard] -= request.budget
            request.budget = 0

    # -- what runs next ----------------------------------------------------------------

    def running(self) -> list[Sequence]:
        return [s for s in self.slots if s is not None and s.finish_reason is None]

    def tokens_held(self) -> int:
        """Positions whose keys and values the running samples hold in the pool."""
        return sum(s.pos - 1 for s in self.running()) + sum(r.prefilled for r in self.prefilling)

    def stats(self, per_page: int, computed: int) -> EngineStats:
        """The engine's `EngineStats`, every shard's pool summed; `per_page` bytes per
        page, `computed` the prompt positions prefilled."""
        total = lambda name: sum(getattr(pool, name) for pool in self.pools)
        return EngineStats(
            pages_total=total("n_pages") - len(self.pools), pages_free=total("free"), pages_used=total("used"),
            pages_cached=total("cached"), running=len(self.running()), prefilling=len(self.prefilling),
            waiting=len(self.waiting), tokens_held=self.tokens_held(), kv_bytes_held=total("used") * per_page,
            kv_bytes_per_token=per_page // self.pools[0].page_size, prefix_hit_tokens=self.hit_rows,
            prompt_tokens_computed=computed,
        )  # fmt: skip
