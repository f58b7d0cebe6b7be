"""Which pages of the device's key/value pool hold what: reference counts and prefix hashes.

Host-side bookkeeping only (no JAX): the engine's scheduler asks a `PagePool` for pages,
writes keys and values into them on the device, and gives them back. A full page is
registered under the chained hash of every token up to its end, so a later request with
the same prompt prefix finds it with `match` and shares it instead of recomputing it;
forks (n samples of one prompt) share pages by `retain`. A cached page nobody holds stays
cached until `allocate` needs it, least recently released first (vLLM's prefix caching,
nano-vllm's `block_manager.py`).
"""

from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence


def page_hashes(tokens: Sequence[int], page_size: int, extra: Hashable = None) -> list[int]:
    """The chained hash of each full page of `tokens`.

    Page `i` hashes to `hash((h_{i-1}, tuple(its tokens), extra))` with `h_{-1} = None`,
    so equal hashes mean equal prefixes up to the end of the page (up to a hash collision),
    and a change anywhere changes the hash of that page and every later one. `extra` keys
    whatever else the keys and values depend on (an adapter's name, a cache dtype).

    Python's hash of ints, tuples and `None` ignores `PYTHONHASHSEED` but that of `None`
    follows its address, so a hash means something only inside the process that made it.

    **Arguments:**

    - `tokens`: the token ids; a last partial page gets no hash.
    - `page_size`: tokens per page.
    - `extra`: any hashable value mixed into every page's hash.

    **Returns:**

    A list of `len(tokens) // page_size` ints.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}.")
    hashes, h = [], None
    for start in range(0, len(tokens) - page_size + 1, page_size):
        h = hash((h, tuple(tokens[start : start + page_size]), extra))
        hashes.append(h)
    return hashes


class PagePool:
    """Pages `1 .. n_pages - 1` of a device pool of `n_pages` pages of `page_size` rows
    (`first + 1 .. first + n_pages - 1` for one data shard's part of a larger pool).

    Page 0 (`first`) is the null page: padded writes go there, and it is never handed out. Every
    other page is in exactly one of three states:

    - free: holds nothing anyone will read; `allocate` takes these first, oldest first;
    - referenced: held by one or more requests (`retain` adds a holder, `release` drops one);
    - evictable: cached under a hash, held by nobody; `match` can still find it, and
      `allocate` reuses the least recently released one when no free page is left.

    A caller that shares the pages `match` returned must `retain` them before its next
    `allocate`, which may otherwise evict them. Release a request's pages last page first,
    so that its prefix, shared by most other requests, is evicted last.

    **Arguments:**

    - `n_pages`: pages in the device pool, the null page included (>= 2).
    - `page_size`: rows (tokens) per page (>= 1).
    - `first`: the id of this pool's null page; its pages follow it.
    """

    def __init__(self, n_pages: int, page_size: int, first: int = 0):
        if n_pages < 2:
            raise ValueError(f"n_pages must be >= 2 (page 0 is the null page), got {n_pages}.")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}.")
        self.n_pages = n_pages
        self.page_size = page_size
        self.first = first
        self._free: deque[int] = deque(range(first + 1, first + n_pages))  # uncached, no reference
        self._refs: dict[int, int] = {}  # page -> reference count (> 0)
        self._page_of: dict[int, int] = {}  # hash -> page
        self._hash_of: dict[int, int] = {}  # page -> hash
        self._evictable: OrderedDict[int, None] = OrderedDict()  # least recently used first

    @property
    def free(self) -> int:
        """Pages `allocate` can hand out now: free ones and evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def used(self) -> int:
        """Pages held by at least one request."""
        return len(self._refs)

    @property
    def cached(self) -> int:
        """Pages registered under a hash, held or not."""
        return len(self._hash_of)

    def refs(self, page: int) -> int:
        """How many holders `page` has (0 for a free or evictable page)."""
        return self._refs.get(page, 0)

    def allocate(self) -> int:
        """A page with one reference: a free one, else the least recently released cached one."""
        if self._free:
            page = self._free.popleft()
        elif self._evictable:
            page, _ = self._evictable.popitem(last=False)
            del self._page_of[self._hash_of.pop(page)]
        else:
            raise RuntimeError(
                f"no free page: all {self.n_pages - 1} pages are held; release some or "
                "make the pool larger."
            )
        self._refs[page] = 1
        return page

    def retain(self, page: int) -> None:
        """One more holder of `page`, which must be held or cached (from `match`)."""
        if page in self._refs:
            self._refs[page] += 1
        elif page in self._evictable:
            del self._evictable[page]
            self._refs[page] = 1
        else:
            raise RuntimeError(f"page {page} is neither held nor cached; allocate a page instead.")

    def release(self, page: int) -> None:
        """One holder of `page` less; with none left it becomes evictable if cached, else free."""
        refs = self._refs.get(page, 0)
        if refs == 0:
            raise RuntimeError(f"page {page} has no reference to release.")
        if refs > 1:
            self._refs[page] = refs - 1
            return
        del self._refs[page]
        if page in self._hash_of:
            self._evictable[page] = None  # most recently used: evicted last
        else:
            self._free.append(page)

    def register(self, page: int, page_hash: int) -> None:
        """Record that held `page` is the full page whose chain hash is `page_hash`.

        A hash already registered keeps its page, and this call does nothing.
        """
        if page not in self._refs:
            raise RuntimeError(f"page {page} is not held; register a page you hold.")
        if page_hash in self._page_of:
            return
        if page in self._hash_of:
            raise RuntimeError(f"page {page} is already registered under another hash.")
        self._page_of[page_hash] = page
        self._hash_of[page] = page_hash

    def match(self, hashes: Sequence[int]) -> list[int]:
        """The cached pages of the longest prefix of `hashes` that are all registered.

        The pages are not retained: `retain` each one to share it. Each one nobody holds
        becomes the most recently used of the evictable pages.
        """
        pages = []
        for page_hash in hashes:
            page = self._page_of.get(page_hash)
            if page is None:
                break
            if page in self._evictable:
                self._evictable.move_to_end(page)
            pages.append(page)
        return pages

    def check(self) -> None:
        """Raise `AssertionError` if any invariant of the pool does not hold."""
        free, held, evictable = set(self._free), set(self._refs), set(self._evictable)
        hashed = set(self._hash_of)
        if len(free) != len(self._free):
            raise AssertionError(f"the free list holds duplicates: {list(self._free)}")
        if free & held or free & evictable or held & evictable:
            raise AssertionError(f"a page in two states: {free=}, {held=}, {evictable=}")
        if free | held | evictable != set(range(self.first + 1, self.first + self.n_pages)):
            raise AssertionError(f"pages lost or out of range: {free=}, {held=}, {evictable=}")
        if len(free) + len(held) + len(evictable) != self.n_pages - 1:
            raise AssertionError("the counts do not add up to n_pages - 1")
        if any(n <= 0 for n in self._refs.values()):
            raise AssertionError(f"a reference count <= 0: {self._refs}")
        if len(self._page_of) != len(hashed) or any(
            self._page_of.get(h) != page for page, h in self._hash_of.items()
        ):
            raise AssertionError(f"not inverse: {self._page_of=}, {self._hash_of=}")
        if self.first in hashed or free & hashed:
            raise AssertionError(f"free or null pages with a hash: {sorted(hashed - held)}")
        if not evictable <= hashed:
            raise AssertionError(f"evictable pages without a hash: {sorted(evictable - hashed)}")
