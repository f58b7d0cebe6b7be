"""The constraint of a `generate` call, checked and merged on the host into one
`ConstraintTable` (see `_constraint.py` for what the loop does with it).

The table's layout, in state order: state 0 is FREE (everything allowed, accepting,
leads back to itself); then each distinct automaton's states, renumbered; then, with
`think_end`, one THINK chain per automaton: `len(think_end)` states, state `j` having
matched the first `j` ids of `think_end`, everything allowed but not accepting (no EOS
while thinking), and the token that completes the sequence leading to the automaton's
start. A mismatched token falls back as the Knuth-Morris-Pratt automaton does (to the
longest prefix of `think_end` that ends the text), so `[a, a, b]` is found in `a a a b`.

The capacity, `(states, exceptions)`, is part of the program's shape: by default each is
the smallest power of two holding the call's table, at least `MIN_CAPACITY`, so up to 64
states and 1024 exceptions (any number of schemas that fit) run one program;
`constraint_capacity=` pins it.
"""

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from .._checks import check_int
from ._automaton import Automaton
from ._constraint import FREE, Constraint, ConstraintTable

MIN_CAPACITY = (64, 1024)  # (states, exceptions)
SPARE_TOKEN = np.iinfo(np.int32).max
_KEPT = 8  # merged tables kept on the device, by the automata they hold
_TABLES: dict[tuple, tuple[list, ConstraintTable, list[int]]] = {}


def _bucket(n: int, low: int) -> int:
    return max(low, 1 << (max(n, 1) - 1).bit_length())


def check_automaton(automaton, name: str, vocab: int | None) -> None:
    """A `TypeError`/`ValueError` naming `name` (`constraint[2]`) for what is not a
    consistent `Automaton` over the model's `vocab` token ids."""
    if not isinstance(automaton, Automaton):
        compile_hint = (
            f" ({type(automaton).__name__} has a compile method: generate sees only ids, so pass "
            f"{name}.compile(tokenizer, vocab=model.vocab_size), or use generate_text, which "
            "compiles it)"
            if callable(getattr(automaton, "compile", None))
            else ""
        )
        raise TypeError(
            f"{name} must be an eqrope Automaton (or None for no constraint), got "
            f"{type(automaton).__name__}{compile_hint}."
        )
    if vocab is not None and automaton.vocab != vocab:
        raise ValueError(
            f"{name} covers {automaton.vocab} token ids, but the model's vocab_size is {vocab}; "
            f"compile it with the model's vocabulary (vocab={vocab})."
        )
    s = np.shape(automaton.default_next)[0] if np.ndim(automaton.default_next) == 1 else -1
    e = np.shape(automaton.exc_token)[0] if np.ndim(automaton.exc_token) == 1 else -1
    words = -(-automaton.vocab // 32)
    shapes = {
        "allowed": (automaton.allowed, (s, words), np.uint32),
        "default_next": (automaton.default_next, (s,), np.int32),
        "exc_start": (automaton.exc_start, (s + 1,), np.int32),
        "exc_token": (automaton.exc_token, (e,), np.int32),
        "exc_next": (automaton.exc_next, (e,), np.int32),
        "accepting": (automaton.accepting, (s,), np.bool_),
    }
    for field, (array, shape, dtype) in shapes.items():
        array = np.asarray(array)
        if s < 1 or array.shape != shape or array.dtype != dtype:
            raise ValueError(
                f"{name}.{field} is {array.dtype}{array.shape}, but an Automaton of {s} states, "
                f"{e} exceptions and vocab {automaton.vocab} needs {np.dtype(dtype)}{shape} "
                "(see eqrope.generation._automaton.Automaton)."
            )
    start = np.asarray(automaton.exc_start)
    tokens, follow = np.asarray(automaton.exc_token), np.asarray(automaton.exc_next)
    problems = [
        (start[0] != 0 or start[-1] != e or np.any(np.diff(start) < 0), "exc_start must rise from 0 to the exceptions' count"),
        (np.any((automaton.default_next < 0) | (automaton.default_next >= s)), "default_next holds a state outside 0 .. S - 1"),
        (np.any((follow < 0) | (follow >= s)), "exc_next holds a state outside 0 .. S - 1"),
        (np.any((tokens < 0) | (tokens >= automaton.vocab)), "exc_token holds an id outside the vocabulary"),
    ]  # fmt: skip
    if e > 1 and not problems[0][0]:
        state_of = np.repeat(np.arange(s), np.diff(start))
        same = state_of[1:] == state_of[:-1]
        problems.append((np.any(same & (tokens[1:] <= tokens[:-1])), "exc_token is not sorted within each state"))
    for bad, what in problems:
        if bad:
            raise ValueError(f"{name}: {what}; rebuild it (eqrope.structured compiles consistent ones).")


def think_chain(think: tuple[int, ...], base: int, target: int):
    """The THINK states `base .. base + m - 1` before the state `target` (see the module's
    docstring): `(default_next, exceptions per state as [(token, next)])`."""
    m = len(think)
    default, exceptions = np.full((m,), base, np.int32), []
    for j in range(m):
        row = []
        for c in sorted(set(think)):
            text = think[:j] + (c,)  # the longest prefix of `think` that ends `text`
            k = next(k for k in range(min(len(text), m), -1, -1) if text[len(text) - k :] == think[:k])
            following = target if k == m else base + k
            if following != base:
                row.append((c, following))
        exceptions.append(row)
    return default, exceptions


def merge(
    automata: Sequence[Automaton], think: tuple[int, ...] | None, vocab: int, capacity: tuple[int, int] | None
) -> tuple[ConstraintTable, list[int]]:
    """The NumPy table of the distinct `automata` (see the module's docstring) and the
    start state of each: its THINK chain's first state with `think`, else its own."""
    words = -(-vocab // 32)
    allowed = [np.full((1, words), 0xFFFFFFFF, np.uint32)]
    default, accepting = [np.array([FREE], np.int32)], [np.array([True])]
    counts, exc_token, exc_next = [np.zeros((1,), np.int64)], [], []
    offsets, offset = [], 1
    for a in automata:
        offsets.append(offset)
        allowed.append(np.asarray(a.allowed))
        default.append(np.asarray(a.default_next) + offset)
        accepting.append(np.asarray(a.accepting))
        counts.append(np.diff(np.asarray(a.exc_start)))
        exc_token.append(np.asarray(a.exc_token))
        exc_next.append(np.asarray(a.exc_next) + offset)
        offset += len(a.default_next)
    starts = list(offsets)
    if think:
        for i, target in enumerate(offsets):
            chain_default, chain = think_chain(think, offset, target)
            starts[i] = offset
            allowed.append(np.full((len(think), words), 0xFFFFFFFF, np.uint32))
            default.append(chain_default)
            accepting.append(np.zeros((len(think),), np.bool_))
            counts.append(np.array([len(row) for row in chain]))
            exc_token.append(np.array([c for row in chain for c, _ in row], np.int32))
            exc_next.append(np.array([n for row in chain for _, n in row], np.int32))
            offset += len(think)
    counts = np.concatenate(counts)
    states, exceptions = offset, int(counts.sum())
    if capacity is None:
        capacity = (_bucket(states, MIN_CAPACITY[0]), _bucket(exceptions, MIN_CAPACITY[1]))
    elif states > capacity[0] or exceptions > capacity[1]:
        raise ValueError(
            f"the constraints need {states} states and {exceptions} exceptions (with FREE and any "
            f"THINK states), more than constraint_capacity={tuple(capacity)}; pass "
            f"constraint_capacity=({max(states, capacity[0])}, {max(exceptions, capacity[1])}) or "
            "more, or None to size it from the constraints."
        )
    n_states, n_exc = capacity
    table = ConstraintTable(
        allowed=np.zeros((n_states, words), np.uint32),
        default_next=np.zeros((n_states,), np.int32),
        exc_start=np.full((n_states + 1,), exceptions, np.int32),
        exc_token=np.full((n_exc,), SPARE_TOKEN, np.int32),
        exc_next=np.zeros((n_exc,), np.int32),
        accepting=np.zeros((n_states,), np.bool_),
    )
    table.allowed[:states] = np.concatenate(allowed)
    table.default_next[:states] = np.concatenate(default)
    table.accepting[:states] = np.concatenate(accepting)
    table.exc_start[: states + 1] = np.concatenate([[0], np.cumsum(counts)])
    if exc_token:
        table.exc_token[:exceptions] = np.concatenate(exc_token)
        table.exc_next[:exceptions] = np.concatenate(exc_next)
    return table, starts


def constraint_of(
    constraint, think_end, constraint_capacity, *, batch: int, batched: bool, samples: int | None, vocab: int | None
) -> Constraint | None:
    """The checked `Constraint` of a `generate` call's `constraint`, `think_end` and
    `constraint_capacity` arguments (`None` without any constraint), for `batch` prompts
    decoded `samples` times each."""
    if constraint is None:
        rows = [None] * batch
    elif isinstance(constraint, list) or (isinstance(constraint, tuple) and not isinstance(constraint, Automaton)):
        if len(constraint) != batch:
            what = f"a batch of {batch} prompts" if batched else "a 1-D prompt (one row)"
            raise ValueError(
                f"constraint is a list of {len(constraint)}, but {what} takes one entry per "
                "prompt (None for no constraint), or one Automaton for every prompt."
            )
        rows = list(constraint)
        names = [f"constraint[{i}]" for i in range(batch)]
    else:
        rows, names = [constraint] * batch, ["constraint"] * batch
    think = check_think(think_end, vocab)
    if constraint_capacity is not None:
        constraint_capacity = check_capacity(constraint_capacity)
    if all(a is None for a in rows):
        if think is not None or constraint_capacity is not None:
            given = "think_end" if think is not None else "constraint_capacity"
            raise ValueError(f"{given} applies to constrained rows; pass constraint= too, or drop {given}.")
        return None
    distinct: dict[int, tuple[Automaton, str]] = {}
    for a, name in zip(rows, names):
        if a is not None and id(a) not in distinct:
            if not isinstance(a, Automaton):
                check_automaton(a, name, vocab)
            distinct[id(a)] = (a, name)
    automata = [a for a, _ in distinct.values()]
    vocab = vocab if vocab is not None else automata[0].vocab
    table, starts = _kept_table(list(distinct.values()), think, vocab, constraint_capacity)
    start_of = dict(zip(distinct, starts))
    start = np.array([FREE if a is None else start_of[id(a)] for a in rows], np.int32)
    return Constraint(table, np.repeat(start, samples or 1))


def _kept_table(named: list[tuple[Automaton, str]], think, vocab, capacity):
    """`merge`'s table on the device, for automata checked here (`check_automaton`), kept
    for the latest `_KEPT` sets of automata (the kept entry holds them, so their ids stay
    theirs: a kept set was checked)."""
    automata = [a for a, _ in named]
    key = (tuple(map(id, automata)), think, vocab, capacity)
    kept = _TABLES.get(key)
    if kept is not None and all(a is b for a, b in zip(kept[0], automata)):
        return kept[1], kept[2]
    for a, name in named:
        check_automaton(a, name, vocab)
    table, starts = merge(automata, think, vocab, capacity)
    table = ConstraintTable(*(jnp.asarray(field) for field in table))
    if len(_TABLES) >= _KEPT:
        del _TABLES[next(iter(_TABLES))]
    _TABLES[key] = (list(automata), table, starts)
    return table, starts


def check_think(think_end, vocab) -> tuple[int, ...] | None:
    if think_end is None:
        return None
    if isinstance(think_end, (str, bytes)) or not isinstance(think_end, (list, tuple, np.ndarray)):
        raise TypeError(
            f"think_end must be a list of token ids (the end-of-thinking sequence, e.g. "
            f"tokenizer.encode('</think>')), got {type(think_end).__name__}."
        )
    ids = tuple(check_int(t, f"think_end[{i}]", minimum=0) for i, t in enumerate(think_end))
    outside = [i for i, t in enumerate(ids) if vocab is not None and t >= vocab]
    if outside:
        i = outside[0]
        raise ValueError(
            f"think_end[{i}] = {ids[i]} is outside the model's vocabulary (vocab_size {vocab}); "
            "pass the tokenizer's ids of the end-of-thinking text."
        )
    if not ids:
        raise ValueError("think_end is empty; pass the end-of-thinking token ids, or None for no THINK state.")
    return ids


def check_capacity(capacity) -> tuple[int, int]:
    if not isinstance(capacity, (list, tuple)) or len(capacity) != 2:
        raise TypeError(
            f"constraint_capacity must be (states, exceptions), two ints, or None, got {capacity!r}."
        )
    return (
        check_int(capacity[0], "constraint_capacity[0] (states)", minimum=1),
        check_int(capacity[1], "constraint_capacity[1] (exceptions)", minimum=1),
    )
