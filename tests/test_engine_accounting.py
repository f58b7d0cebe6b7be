"""The engine's page accounting under 10,000 random submit, step and cancel events.

The engine's host side (admission, page allocation, prefix sharing, samples, cancel,
release) runs for real; the device side is a fake `Runner` that moves each slot forward as
the compiled programs would, and checks every write they would make against the pool:
each row a program writes must lie in a page its sequence holds alone (never a shared
prefix page, never another request's page, never unallocated), and every row a sequence
reads must be in a page it holds. After each event the pool's own invariants hold and
every page's reference count equals the holders the engine's records give it; at the end
nothing is held.
"""

import collections

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from _models import random_model

import eqrope


PAGE, MAX_LEN, VOCAB = 4, 32, 13


class FakePool:
    def bytes_per_page(self) -> int:
        return 2 * PAGE * 4


class FakeRunner:
    """The programs' effect on positions, with every page a write would touch checked."""

    def __init__(self, engine):
        self.engine, self.pool, self.slot = engine, FakePool(), {}

    def _holders(self):
        """How many sequences or prefilling prompts hold each page, from the engine's records."""
        s = self.engine.scheduler
        count = collections.Counter()
        for holder in [*(q for q in s.slots if q is not None), *s.prefilling]:
            count.update(holder.pages)
        return count

    def _writes(self, table, rows, what):
        holders = self._holders()
        for row in rows:
            page = int(table[row // PAGE])
            assert page != 0, f"{what} writes row {row} into no page"
            assert holders[page] == 1, f"{what} writes row {row} into page {page}, held {holders[page]} times"

    def prefill(self, tables, ids, starts, last, live):
        for r in np.flatnonzero(live):
            request = next(q for q in self.engine.scheduler.prefilling if q.pages and list(tables[r, : len(q.pages)]) == q.pages)
            end = min(int(starts[r]) + ids.shape[1], len(request.prompt))
            self._writes(tables[r], range(int(starts[r]), end), "prefill")
        return np.zeros((len(live), VOCAB), np.float32)

    def start(self, slot, logits, prompt, sampling, key, max_new, check_finite):
        self.slot[slot] = dict(pos=len(prompt) + 1, new=1, max_new=max_new, length=len(prompt))
        return np.int32(1), np.float32(0.0), np.bool_(max_new <= 1), np.bool_(False)

    def decode(self, rows, live, tables, sampling, keys, max_new, steps, exit_after, check_finite):
        view = {k: [] for k in ("tokens", "logprobs", "pos", "done", "nonfinite")}
        for r, slot in enumerate(rows):
            state = self.slot.get(int(slot))
            if live[r]:
                k = min(steps, state["max_new"] - state["new"])
                # It reads rows 0 .. pos - 2 (held) and writes rows pos - 1 .. pos + k - 2.
                assert all(tables[r, : (state["pos"] - 1 + PAGE - 1) // PAGE] != 0)
                self._writes(tables[r], range(state["pos"] - 1, state["pos"] - 1 + k), "decode")
                state["pos"] += k
                state["new"] += k
            tokens = np.full(MAX_LEN, 1, np.int32)
            view["tokens"].append(tokens)
            view["logprobs"].append(np.zeros(MAX_LEN, np.float32))
            view["pos"].append(state["pos"] if state else 0)
            view["done"].append(bool(state) and state["new"] >= state["max_new"])
            view["nonfinite"].append(False)
        return {k: np.asarray(v) for k, v in view.items()}

    def copy(self, pairs):
        holders = self._holders()
        for source, target in pairs:
            assert holders[target] == 1 and holders[source] >= 1


@pytest.fixture(scope="module")
def model():
    return random_model(0, VOCAB, 16, 2, 1, MAX_LEN)


def check(engine):
    s, pool = engine.scheduler, engine.scheduler.pool
    pool.check()
    holders = collections.Counter()
    for holder in [*(q for q in s.slots if q is not None), *s.prefilling]:
        holders.update(holder.pages)
    for page in range(1, pool.n_pages):
        assert pool.refs(page) == holders[page], (page, pool.refs(page), holders[page])
    assert pool.free >= s.reserved >= 0


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1))
def test_pages_are_never_leaked_or_doubly_owned(model, seed):
    rng = np.random.default_rng(seed)
    engine = eqrope.Engine(model, slots=3, page_size=PAGE, pages=20, max_len=MAX_LEN,
                           prefill_chunk=8, decode_steps=int(rng.integers(1, 6)), max_waiting=6)  # fmt: skip
    engine.runner = FakeRunner(engine)
    prefixes = [rng.integers(0, VOCAB, 12).tolist() for _ in range(2)]
    live = []
    for _ in range(1000):  # 10 examples: 10,000 events
        event = rng.choice(["submit", "step", "cancel"], p=[0.35, 0.5, 0.15])
        if event == "submit":
            head = prefixes[rng.integers(2)][: rng.integers(0, 13)]
            prompt = np.asarray(head + rng.integers(0, VOCAB, rng.integers(1, 6)).tolist(), np.int32)
            samples = [None, None, 2, 3][rng.integers(4)]
            max_new = int(rng.integers(1, MAX_LEN - len(prompt) + 1))
            try:
                live.append(engine.submit(prompt, max_new=max_new, num_samples=samples))
            except (RuntimeError, ValueError) as error:  # a full queue, or too large for the pool
                assert "waiting queue is full" in str(error) or "more pages" in str(error)
        elif event == "step":
            engine.step()
        elif live:
            request_id = live.pop(int(rng.integers(len(live))))
            if request_id in engine._requests:
                engine.cancel(request_id)
        check(engine)
    while engine.has_work():
        engine.step()
        check(engine)
    pool = engine.scheduler.pool
    assert pool.used == 0 and pool.free == pool.n_pages - 1 and engine.scheduler.reserved == 0
