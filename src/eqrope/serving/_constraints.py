"""Structured output in the engine: the running requests' automata in one fixed-capacity
table on the device, and each slot's automaton state beside it (opt-in with
`Engine(constraint_capacity=(states, exceptions))`).

The table has `generate`'s layout (`eqrope.generation._constraint.ConstraintTable`; the
mask and the step are `_constraint.py`'s, as `generate` runs them): state 0 is FREE, so
a request without a constraint passes untouched. Each distinct automaton that a request
holds gets a *block*: its states, renumbered from the block's first, and one spare state
after them, and a run of exceptions. Blocks lie in the same order in both ranges, so
the table's `exc_start` rises; the spare state after a block spans the gap to the next
block's exceptions (spare entries, which no token matches, and no row ever reaches it).

Plain host bookkeeping, like the scheduler's pages: a block counts the requests holding
it, and is freed when the last one ends; a request takes its block when it is admitted,
and waits in the queue while the table has no room for it (first fit). A new schema is
a new traced value of the same shapes: it compiles nothing.

With `think_end`, a request's automaton is `thinking`'s: `generate`'s THINK chain
(`_constraint_table.py`: everything allowed but EOS, until the end-of-thinking ids)
before the automaton's states, as one automaton of its own, kept per (automaton, ids).
"""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from ..generation._automaton import Automaton
from ..generation._constraint import FREE, ConstraintTable, advance, constrain_logits
from ..generation._constraint_table import SPARE_TOKEN, check_capacity, check_think, think_chain, check_automaton
from ..generation._sampling import Sampling, choose_rows, model_logprob


class SlotConstraints(NamedTuple):
    """The device side: the `table`, and each slot's automaton `states` (`(slots,)`)."""

    table: ConstraintTable
    states: Int[Array, " slots"]


@dataclasses.dataclass(eq=False)
class _Block:
    automaton: Automaton
    state: int  # its first state; the spare state is `state + size(automaton)[0] - 1`
    exception: int  # its first exception
    holders: int = 0


def size(automaton: Automaton) -> tuple[int, int]:
    """The states (with the spare one) and the exceptions a block of `automaton` takes."""
    return len(automaton.default_next) + 1, len(automaton.exc_token)


def fits(automaton: Automaton, capacity: tuple[int, int]) -> bool:
    """Whether an empty table of `capacity` (FREE and nothing else) holds `automaton`."""
    states, exceptions = size(automaton)
    return states + 1 <= capacity[0] and exceptions <= capacity[1]


def constraint_blocks(capacity, vocab: int, mesh) -> "ConstraintBlocks | None":
    """The engine's `ConstraintBlocks`, or `None` without a `capacity` (constraints off)."""
    if capacity is not None and mesh is not None:
        raise ValueError("constraint_capacity runs on one device for now; drop mesh= or constraint_capacity=.")
    return None if capacity is None else ConstraintBlocks(capacity, vocab)


class ConstraintBlocks:
    """The host's copy of the table, its blocks, and which request holds which block."""

    def __init__(self, capacity, vocab: int):
        self.capacity = check_capacity(capacity)
        self.vocab = vocab
        states, exceptions = self.capacity
        if states < 2:
            raise ValueError(f"constraint_capacity={capacity}: the table needs FREE and at least one state more.")
        words = -(-vocab // 32)
        self.host = ConstraintTable(
            allowed=np.zeros((states, words), np.uint32),
            default_next=np.zeros((states,), np.int32),
            exc_start=np.zeros((states + 1,), np.int32),
            exc_token=np.full((exceptions,), SPARE_TOKEN, np.int32),
            exc_next=np.zeros((exceptions,), np.int32),
            accepting=np.zeros((states,), np.bool_),
        )
        self.host.allowed[FREE], self.host.accepting[FREE] = 0xFFFFFFFF, True
        self.blocks: dict[int, _Block] = {}  # by the automaton's id (the block keeps it alive)
        self.held: dict[int, _Block] = {}  # by request id
        self.thinking_kept: dict[tuple, tuple[Automaton, Automaton]] = {}  # (id, ids): (automaton, with THINK)
        self._device: ConstraintTable | None = None

    def request(self, constraint, think_end) -> Automaton | None:
        """`Engine.submit`'s checked `constraint` (with its THINK chain, given `think_end`)."""
        if constraint is None:
            if think_end is not None:
                raise ValueError("think_end applies to a constrained request; pass constraint= too, or drop think_end.")
            return None
        self.check(constraint)
        think = check_think(think_end, self.vocab)
        if think is None:
            return constraint
        key = (id(constraint), think)
        if key not in self.thinking_kept:
            if len(self.thinking_kept) >= 32:
                del self.thinking_kept[next(iter(self.thinking_kept))]
            self.thinking_kept[key] = (constraint, thinking(constraint, think))
        self.check(self.thinking_kept[key][1])
        return self.thinking_kept[key][1]

    def check(self, automaton, name: str = "constraint") -> None:
        """A `TypeError`/`ValueError` naming `name` for what is not an `Automaton` over the
        model's vocabulary, or one that even an empty table cannot hold."""
        check_automaton(automaton, name, self.vocab)
        (states, exceptions), (cap_states, cap_exceptions) = size(automaton), self.capacity
        if not fits(automaton, self.capacity):
            raise ValueError(
                f"{name} needs {states + 1} states (with FREE and a spare one) and {exceptions} "
                f"exceptions, more than the engine's constraint_capacity={self.capacity}; build the "
                f"Engine with constraint_capacity=({max(states + 1, cap_states)}, "
                f"{max(exceptions, cap_exceptions)}) or more."
            )

    def hold(self, request_id: int, automaton: Automaton | None) -> bool:
        """Whether the request may start: it has no constraint, or its automaton's block is
        (now) in the table. Holding twice counts once."""
        if automaton is None or request_id in self.held:
            return True
        block = self.blocks.get(id(automaton)) or self._place(automaton)
        if block is None:
            return False
        block.holders += 1
        self.held[request_id] = block
        return True

    def release(self, request_id: int) -> None:
        """The request has ended: its block loses a holder, and is freed with the last."""
        block = self.held.pop(request_id, None)
        if block is None:
            return
        block.holders -= 1
        if block.holders == 0:
            del self.blocks[id(block.automaton)]
            self._write(block, clear=True)

    def start(self, request_id: int) -> int:
        """The state a request's samples start in: its automaton's first, or FREE."""
        block = self.held.get(request_id)
        return FREE if block is None else block.state

    def device(self) -> ConstraintTable:
        """The table on the device, copied there again only after it changed."""
        if self._device is None:
            self._device = ConstraintTable(*(jnp.asarray(np.array(field)) for field in self.host))
        return self._device

    def _place(self, automaton: Automaton) -> _Block | None:
        """A new block for `automaton` in the first gap that holds it, or `None`."""
        states, exceptions = size(automaton)
        at_state, at_exception = FREE + 1, 0
        for block in sorted(self.blocks.values(), key=lambda b: b.state):
            if block.state - at_state >= states and block.exception - at_exception >= exceptions:
                break
            at_state, at_exception = block.state + size(block.automaton)[0], block.exception + size(block.automaton)[1]
        else:
            if self.capacity[0] - at_state < states or self.capacity[1] - at_exception < exceptions:
                return None
        block = _Block(automaton, at_state, at_exception)
        self.blocks[id(automaton)] = block
        self._write(block, clear=False)
        return block

    def _write(self, block: _Block, *, clear: bool) -> None:
        """Write a block's states and exceptions (or spare ones over them, to `clear` it),
        then every state's `exc_start` from the blocks."""
        a, host = block.automaton, self.host
        states, exceptions = size(a)
        real = slice(block.state, block.state + states - 1)
        own = slice(block.exception, block.exception + exceptions)
        host.allowed[block.state : block.state + states] = 0
        host.accepting[real] = False if clear else a.accepting
        host.default_next[real] = 0 if clear else np.asarray(a.default_next) + block.state
        host.exc_token[own] = SPARE_TOKEN if clear else a.exc_token
        host.exc_next[own] = 0 if clear else np.asarray(a.exc_next) + block.state
        if not clear:
            host.allowed[real] = a.allowed
        # Each block's states start at its exceptions' offsets; a state outside every
        # block (a spare one, a free gap) starts where the block before it ended.
        starts, forced = np.zeros_like(host.exc_start), np.zeros(host.exc_start.shape, bool)
        for b in self.blocks.values():
            n = size(b.automaton)[0]
            starts[b.state : b.state + n] = b.exception + np.asarray(b.automaton.exc_start)
            forced[b.state : b.state + n] = True
        forced[0] = True
        host.exc_start[:] = np.maximum.accumulate(np.where(forced, starts, 0))
        self._device = None


def thinking(automaton: Automaton, think: tuple[int, ...]) -> Automaton:
    """`automaton` after a THINK chain of `len(think)` states (`_constraint_table.think_chain`),
    which starts it: free text without EOS until the ids `think`, then `automaton`."""
    m, words = len(think), np.shape(automaton.allowed)[1]
    default, chain = think_chain(think, 0, m)
    i32 = lambda x: np.asarray(x, np.int32)
    counts = [len(row) for row in chain] + np.diff(automaton.exc_start).tolist()
    return Automaton(
        allowed=np.concatenate([np.full((m, words), 0xFFFFFFFF, np.uint32), automaton.allowed]),
        default_next=i32(np.concatenate([default, np.asarray(automaton.default_next) + m])),
        exc_start=i32(np.concatenate([[0], np.cumsum(counts)])),
        exc_token=i32([c for row in chain for c, _ in row] + list(automaton.exc_token)),
        exc_next=i32([n for row in chain for _, n in row] + (np.asarray(automaton.exc_next) + m).tolist()),
        accepting=np.concatenate([np.zeros((m,), np.bool_), automaton.accepting]),
        vocab=automaton.vocab,
    )


def choose_slots(
    table: ConstraintTable | None,
    states: Int[Array, " rows"] | None,
    logits: Float[Array, "rows vocab"],
    text,
    active: Bool[Array, " rows"],
    keys,
    sampling: Sampling,
):
    """Each slot's token (`choose_rows`); with a `table`, from logits masked by its
    automaton's state first, as `generate`'s decode step does: a row with no token left
    ends with nothing added, the model's own log-probability reads the unmasked logits,
    and each active row's state moves on with its token.

    **Returns:** `(text, active, (token, logprob, own), states)`.
    """
    masked = logits
    if table is not None:
        masked, stuck = constrain_logits(table, states, logits, text.n_new, sampling)
        text = dataclasses.replace(text, done=text.done | (active & stuck))
        active = active & ~stuck
    token, logprob, own = choose_rows(masked, text.history, text.n_new, keys, text.pos, sampling)
    if table is not None:
        own = jax.vmap(model_logprob)(logits, token, sampling)
        states = advance(table, states, token, active)
    return text, active, (token, logprob, own), states
