"""The page pool's bookkeeping: small cases computed by hand, then a simulated engine.

The simulation (a hypothesis state machine) submits, grows, forks and finishes requests
against a `PagePool` and keeps its own model of who holds which page and what each page
holds, so a page handed out twice, a page leaked, or a match to stale contents shows up.
"""

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from eqrope.serving._pages import PagePool, page_hashes


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="n_pages"):
        PagePool(1, 4)
    with pytest.raises(ValueError, match="page_size"):
        PagePool(4, 0)
    with pytest.raises(ValueError, match="page_size"):
        page_hashes([1, 2], 0)


def test_allocation_order_and_counts():
    pool = PagePool(4, 2)
    assert (pool.free, pool.used, pool.cached) == (3, 0, 0)
    assert [pool.allocate() for _ in range(3)] == [1, 2, 3]  # never page 0
    assert (pool.free, pool.used) == (0, 3)
    with pytest.raises(RuntimeError, match="no free page"):
        pool.allocate()
    pool.release(2)
    pool.release(1)
    assert (pool.free, pool.used) == (2, 1)
    assert [pool.allocate(), pool.allocate()] == [2, 1]  # freed pages, oldest first
    pool.check()


def test_release_without_reference_raises():
    pool = PagePool(3, 2)
    with pytest.raises(RuntimeError, match="no reference"):
        pool.release(1)
    page = pool.allocate()
    pool.retain(page)
    pool.release(page)
    pool.release(page)
    with pytest.raises(RuntimeError, match="no reference"):
        pool.release(page)
    with pytest.raises(RuntimeError, match="neither held nor cached"):
        pool.retain(page)  # a free page has no contents worth sharing
    pool.check()


def test_eviction_is_least_recently_released_first():
    pool = PagePool(5, 2)
    pages = [pool.allocate() for _ in range(4)]
    for page, h in zip(pages[:3], [10, 11, 12]):
        pool.register(page, h)
    assert pool.cached == 3
    for page in [pages[1], pages[0], pages[2], pages[3]]:  # page 4 has no hash: free list
        pool.release(page)
    assert (pool.free, pool.used, pool.cached) == (4, 0, 3)
    assert pool.allocate() == 4  # an uncached free page before any eviction
    assert pool.allocate() == 2  # then the least recently released cached page
    assert pool.match([11]) == []  # its hash went with it
    assert pool.cached == 2
    assert pool.match([10]) == [1]  # a match makes page 1 the most recently used
    assert pool.allocate() == 3
    assert pool.allocate() == 1
    assert (pool.free, pool.cached) == (0, 0)
    pool.check()


def test_retain_takes_a_cached_page_out_of_eviction():
    pool = PagePool(3, 2)
    a, b = pool.allocate(), pool.allocate()
    pool.register(a, 7)
    pool.release(a)
    pool.release(b)
    assert pool.match([7]) == [a]
    pool.retain(a)
    assert (pool.free, pool.used, pool.cached) == (1, 1, 1)
    assert pool.allocate() == b
    with pytest.raises(RuntimeError, match="no free page"):
        pool.allocate()
    pool.check()


def test_match_stops_at_the_first_missing_hash():
    pool = PagePool(5, 2)
    pages = [pool.allocate() for _ in range(3)]
    pool.register(pages[0], 100)
    pool.register(pages[2], 102)
    assert pool.match([100, 101, 102]) == [pages[0]]
    assert pool.match([101, 102]) == []
    assert pool.match([]) == []
    pool.register(pages[1], 101)
    assert pool.match([100, 101, 102, 103]) == pages
    pool.check()


def test_a_duplicate_hash_keeps_the_first_page():
    pool = PagePool(4, 2)
    a, b = pool.allocate(), pool.allocate()
    pool.register(a, 5)
    pool.register(b, 5)
    assert pool.match([5]) == [a]
    assert pool.cached == 1
    pool.release(b)  # uncached: straight back to the free list
    assert pool.free == 2
    with pytest.raises(RuntimeError, match="another hash"):
        pool.register(a, 6)
    with pytest.raises(RuntimeError, match="not held"):
        pool.register(b, 6)
    pool.check()


def test_page_hashes():
    tokens = list(range(1, 11))
    hashes = page_hashes(tokens, 4)
    first = hash((None, (1, 2, 3, 4), None))
    assert hashes == [first, hash((first, (5, 6, 7, 8), None))]  # 9, 10: a partial page
    assert page_hashes(tokens[:8], 4) == hashes
    assert page_hashes(tokens[:3], 4) == []
    changed = page_hashes([0] + tokens[1:], 4)
    assert all(x != y for x, y in zip(changed, hashes))  # chained: page 1 changes too
    tail_changed = page_hashes(tokens[:4] + [0] + tokens[5:], 4)
    assert tail_changed[0] == hashes[0] and tail_changed[1] != hashes[1]
    with_extra = page_hashes(tokens, 4, extra="adapter")
    assert all(x != y for x, y in zip(with_extra, hashes))
    assert page_hashes(tokens, 4, extra="adapter") == with_extra


N_PAGES, PAGE_SIZE = 12, 2
PROMPTS = [(0, 1, 0, 1, 1, 0, 0, 1, 1), (0, 1, 0, 1, 0, 0, 1, 1, 0), (1, 1, 0, 0, 1, 0, 1, 0, 1)]
STEPS = {"n": 0}  # rules run, over every example


class Engine(RuleBasedStateMachine):
    """Requests over a small pool, with prompts cut from three sequences so prefixes repeat."""

    @initialize()
    def start(self):
        self.pool = PagePool(N_PAGES, PAGE_SIZE)
        self.requests: dict[int, list[int]] = {}  # request -> its pages, in order
        self.holders: dict[int, int] = {}  # page -> live requests holding it
        self.contents: dict[int, tuple | None] = {}  # page -> the prefix it ends (None: partial)
        self.next_id = 0

    def take(self, page):
        self.holders[page] = self.holders.get(page, 0) + 1

    def allocate(self):
        page = self.pool.allocate()
        assert page != 0 and self.holders.get(page, 0) == 0, f"page {page} handed out twice"
        self.take(page)
        return page

    def finish(self, request, last_first=True):
        pages = self.requests.pop(request)
        for page in reversed(pages) if last_first else pages:
            self.pool.release(page)
            self.holders[page] -= 1
            if self.holders[page] == 0:
                del self.holders[page]

    def pick(self, pick):
        return sorted(self.requests)[pick % len(self.requests)]

    def add(self, pages):
        self.requests[self.next_id] = pages
        self.next_id += 1

    @rule(prompt=st.sampled_from(PROMPTS), length=st.integers(0, 9), extra=st.booleans())
    def submit(self, prompt, length, extra):
        STEPS["n"] += 1
        tokens = list(prompt[:length])
        hashes = page_hashes(tokens, PAGE_SIZE, extra)
        matched = self.pool.match(hashes)
        for i, page in enumerate(matched):
            prefix = (extra, tuple(tokens[: (i + 1) * PAGE_SIZE]))
            assert self.contents[page] == prefix, f"page {page} matched with stale contents"
            self.pool.retain(page)
            self.take(page)
        needed = -(-len(tokens) // PAGE_SIZE) - len(matched)
        if needed > self.pool.free:
            self.add(matched)  # back out: released as any request is
            self.finish(self.next_id - 1)
            return
        pages = list(matched)
        for i in range(len(matched), len(matched) + needed):
            page = self.allocate()
            pages.append(page)
            if i < len(hashes):
                self.contents[page] = (extra, tuple(tokens[: (i + 1) * PAGE_SIZE]))
                self.pool.register(page, hashes[i])
            else:
                self.contents[page] = None
        self.add(pages)

    @precondition(lambda self: self.requests)
    @rule(pick=st.integers(0, 2**16))
    def grow(self, pick):
        STEPS["n"] += 1
        if self.pool.free:
            request = self.pick(pick)
            page = self.allocate()
            self.contents[page] = None
            self.requests[request].append(page)

    @precondition(lambda self: self.requests)
    @rule(pick=st.integers(0, 2**16), last_first=st.booleans())
    def finish_or_cancel(self, pick, last_first):
        STEPS["n"] += 1  # in order, a prompt's first page is evicted first: chains get gaps
        self.finish(self.pick(pick), last_first)

    @precondition(lambda self: self.requests)
    @rule(pick=st.integers(0, 2**16))
    def fork(self, pick):
        STEPS["n"] += 1
        pages = list(self.requests[self.pick(pick)])
        for page in pages:
            self.pool.retain(page)
            self.take(page)
        self.add(pages)

    @invariant()
    def agrees_with_the_model(self):
        self.pool.check()
        held = {page for pages in self.requests.values() for page in pages}
        assert held == set(self.holders) and 0 not in held
        assert all(len(set(pages)) == len(pages) for pages in self.requests.values())
        assert sum(self.holders.values()) == sum(map(len, self.requests.values()))
        assert self.pool.used == len(held)
        assert self.pool.free == N_PAGES - 1 - len(held)
        if not self.requests:
            assert (self.pool.used, self.pool.free) == (0, N_PAGES - 1), "a page leaked"

    def teardown(self):
        if hasattr(self, "pool"):
            for request in sorted(self.requests):
                self.finish(request)
            self.pool.check()
            assert (self.pool.used, self.pool.free) == (0, N_PAGES - 1), "a page leaked"


def test_simulated_engine():
    STEPS["n"] = 0
    run_state_machine_as_test(
        Engine, settings=settings(max_examples=150, stateful_step_count=100, deadline=None)
    )
    assert STEPS["n"] >= 10_000, f"only {STEPS['n']} events"
