"""Who runs: the waiting queue, admission into slots, and every page a request holds.

Plain Python, no JAX (vLLM's `Scheduler`, nano-vllm's `scheduler.py`). A request is
admitted only when it has a slot for each sample and the pool can hold its worst case
(prompt plus `max_new` for every sample): pages are then allocated as positions advance,
a decode chunk's lookahead at a time, and an allocation can never fail, so nothing is
preempted and a request's memory follows its tokens. `Scheduler.reserved` is what the
admitted requests may still allocate; `PagePool.free >= reserved` always.

Prefix reuse: a prompt's full pages are found by their chained hashes (`PagePool.match`)
and shared. The hit is rounded down to a multiple of the prefill piece, so that a request
runs the same prefill pieces at the same offsets whether its prefix was cached or not:
a cache hit cannot change a result.
"""

import collections
import math

from ._pages import PagePool
from ._sequence import Request, Sequence


class Scheduler:
    def __init__(self, pool: PagePool, slots: int, piece: int, max_waiting: int):
        self.pool, self.piece, self.max_waiting = pool, piece, max_waiting
        self.waiting: collections.deque[Request] = collections.deque()
        self.prefilling: list[Request] = []
        self.slots: list[Sequence | None] = [None] * slots
        self.reserved = 0
        self.hit_rows = 0

    # -- admission ---------------------------------------------------------------------

    def worst_case(self, request: Request) -> int:
        """The most pages `request` can ever hold: its shared full prompt pages once, and
        every sample's own pages up to its last position."""
        size = self.pool.page_size
        shared = len(request.prompt) // size
        return shared + request.samples * (math.ceil(request.end / size) - shared)

    def free_slots(self) -> list[int]:
        taken = sum(r.samples for r in self.prefilling)
        free = [i for i, s in enumerate(self.slots) if s is None]
        return free[taken:]

    def admit(self) -> list[Request]:
        """Move waiting requests, in order, into prefilling while slots and pages allow."""
        admitted = []
        while self.waiting and self._admit(self.waiting[0]):
            admitted.append(self.waiting.popleft())
        return admitted

    def _admit(self, request: Request) -> bool:
        if len(self.free_slots()) < request.samples:
            return False
        size, length = self.pool.page_size, len(request.prompt)
        hits = self.pool.match(request.hashes)
        # Hit rows: whole pieces, and at least the prompt's last token left to compute.
        rows = min(len(hits) * size, (length - 1) // self.piece * self.piece)
        hits = hits[: rows // size]
        idle_hits = sum(1 for page in hits if self.pool.refs(page) == 0)
        worst = self.worst_case(request)
        if self.pool.free - self.reserved < worst - len(hits) + idle_hits:
            return False
        for page in hits:
            self.pool.retain(page)
        request.pages, request.prefilled, request.hit_rows = list(hits), rows, rows
        request.budget = worst - len(hits)
        self.reserved += request.budget
        self.hit_rows += rows
        self.prefilling.append(request)
        return True

    # -- pages -------------------------------------------------------------------------

    def allocate(self, request: Request) -> int:
        if request.budget <= 0:
            raise RuntimeError(f"request {request.id} is past its reserved pages (a bug).")
        request.budget -= 1
        self.reserved -= 1
        return self.pool.allocate()

    def grow(self, holder, rows: int, request: Request) -> None:
        """`holder.pages` (a request's prompt, or a sample's) until they hold `rows` rows."""
        while len(holder.pages) * self.pool.page_size < rows:
            holder.pages.append(self.allocate(request))

    def trim(self, sequence: Sequence) -> None:
        """Give back the pages past `sequence`'s written rows (a decode chunk's lookahead
        that an early exit left unwritten), so that between chunks a sample holds at most
        one partly written page. Its reservation takes them back."""
        written = sequence.pos - 1
        while len(sequence.pages) * self.pool.page_size - self.pool.page_size >= max(written, 1):
            self.pool.release(sequence.pages.pop())
            sequence.request.budget += 1
            self.reserved += 1

    def prefilled(self, request: Request) -> None:
        """After its prompt's last piece: register its full pages for later prompts."""
        for page, page_hash in zip(request.pages, request.hashes):
            self.pool.register(page, page_hash)

    def start(self, request: Request) -> list[Sequence]:
        """Put every sample of a prefilled request in a slot. Sample 0 takes the prompt's
        pages; the others share its full pages and get their own copy of its partial last
        page. **Returns:** the samples; the copies to make are `(source, target)` pairs in
        `request.copies`."""
        self.prefilling.remove(request)
        length, size = len(request.prompt), self.pool.page_size
        full = length // size
        slots = self.free_slots()[: request.samples]
        for sample, slot in enumerate(slots):
            if sample == 0:
                pages = request.pages
            else:
                pages = list(request.pages[:full])
                for page in pages:
                    self.pool.retain(page)
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
        for page in reversed(holder.pages):
            self.pool.release(page)
        holder.pages = []

    def finish(self, sequence: Sequence) -> None:
        """A sample ended: its slot and pages are free; once every sample of its request
        has ended, what the request reserved and did not use is given back."""
        self.release(sequence)
        self.slots[sequence.slot] = None
        request = sequence.request
        if request.finished:
            self.reserved -= request.budget
            request.budget = 0

    def drop(self, request: Request) -> None:
        """Take a waiting or prefilling request out (cancelled), freeing what it holds."""
        if request in self.waiting:
            self.waiting.remove(request)
            return
        if request in self.prefilling:
            self.prefilling.remove(request)
            self.release(request)
            self.reserved -= request.budget
            request.budget = 0

    # -- what runs next ----------------------------------------------------------------

    def running(self) -> list[Sequence]:
        return [s for s in self.slots if s is not None and s.finish_reason is None]

    def tokens_held(self) -> int:
        """Positions whose keys and values the running samples hold in the pool."""
        return sum(s.pos - 1 for s in self.running()) + sum(r.prefilled for r in self.prefilling)
