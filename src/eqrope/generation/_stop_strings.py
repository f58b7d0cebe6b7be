"""Stop strings matched on the text, inside the compiled loop.

A stop string ends a row when the bytes its tokens spell contain the string, and the
string reaches into the row's last token: `["st", "op"]`, `["sto", "pper"]` and
`["las", "topper"]` all stop on `"stop"`, however the model happened to tokenize it. This
is transformers' `StopStringCriteria` (`generation/stopping_criteria.py`), kept as arrays
so that the loop never leaves the device.

For each stop string `s` of `m` bytes and each token `t`, the table holds:

- `ends[t, e]`: whether `t` holds the last `e` bytes of `s` with its first bytes, or
  all of `s` (then `e = m`), anywhere inside it: the row's last token starts a match
  with `e` bytes of `s` matched, counting from the end.
- `at[t, c]`: whether `t` fits before `c` matched bytes: its bytes end with the `c`
  bytes before the matched part of `s`, or with all that is left of `s` (running off its
  start).
- `length[t]`: the bytes of `t`.

Walking back from the last token, a match adds each earlier token's length while it fits,
and is complete once it reaches `m`. Only tokens that can take part in a match are kept
(sorted ids, found with a binary search), so the table's size follows the stop strings,
not the vocabulary. Every size is a power of two with a floor (`MIN_SHAPE`): up to four
strings of up to 16 bytes over up to 256 tokens run one compiled program; the strings
themselves are traced values. No stop strings is a table of no strings (`NO_TEXT_STOPS`),
whose program holds no matching at all (a call that then passes strings compiles once
more).
"""

import weakref
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Int


# (tokens, strings, bytes): the smallest table; each size grows by powers of two.
MIN_SHAPE = (256, 4, 16)
_ABSENT = np.iinfo(np.int32).max  # the id of a spare table row: no token has it
_TABLES: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()
_KEPT = 32  # tables kept per tokenizer


class TextStops(NamedTuple):
    """The stop strings of a call as arrays (see the module's docstring).

    - `ids`: the token ids that can take part in a match, sorted, `(tokens,)`; spare rows
      hold 2^31 - 1, which no token has.
    - `length`: each token's length in bytes, at most `width`.
    - `at`: `(tokens, strings, width)`, whether the token fits before `c` matched bytes.
    - `ends`: `(tokens, strings, width + 1)`, whether the row's last token can hold the
      string's last `e` bytes.
    - `target`: each string's length in bytes, `(strings,)`; spare strings `width + 1`.
    """

    ids: Int[ArrayLike, " tokens"]
    length: Int[ArrayLike, " tokens"]
    at: Bool[ArrayLike, "tokens strings width"]
    ends: Bool[ArrayLike, "tokens strings width_1"]
    target: Int[ArrayLike, " strings"]


def _bucket(n: int, low: int) -> int:
    return max(low, 1 << (max(n, 1) - 1).bit_length())


def text_stops(
    token_bytes: Sequence[bytes], strings: Sequence[bytes], floor: tuple[int, int, int] = MIN_SHAPE
) -> TextStops:
    """The `TextStops` table of `strings` over a vocabulary whose token `i` spells
    `token_bytes[i]` (`b""` for a token that spells nothing, such as a special token: a
    match never runs through it), each size at least its `floor`."""
    strings = [bytes(s) for s in strings]
    width = _bucket(max(map(len, strings), default=1), floor[2])
    ends: dict[int, set[tuple[int, int]]] = {}
    at: dict[int, set[tuple[int, int]]] = {}
    for i, s in enumerate(strings):
        m, last = len(s), s[-1:]
        before: dict[int, list[int]] = {}  # byte -> the c whose unmatched part ends with it
        for j in range(m - 1):
            before.setdefault(s[j], []).append(m - 1 - j)
        for t, b in enumerate(token_bytes):
            if not b:
                continue
            k = b.find(last)
            while k >= 0:  # the string's last byte at b[k]: e bytes of it end there
                e = min(k + 1, m)
                if b[k + 1 - e : k + 1] == s[m - e :]:
                    ends.setdefault(t, set()).add((i, e))
                k = b.find(last, k + 1)
            for c in before.get(b[-1], ()):  # t ends where the string's first m - c bytes end
                n = min(len(b), m - c)
                if b[len(b) - n :] == s[m - c - n : m - c]:
                    at.setdefault(t, set()).add((i, c))
    ids = sorted(set(ends) | set(at))
    tokens = _bucket(len(ids), floor[0])
    count = _bucket(len(strings), floor[1])
    table = TextStops(
        ids=np.full((tokens,), _ABSENT, np.int32),
        length=np.zeros((tokens,), np.int32),
        at=np.zeros((tokens, count, width), np.bool_),
        ends=np.zeros((tokens, count, width + 1), np.bool_),
        target=np.full((count,), width + 1, np.int32),
    )
    table.ids[: len(ids)] = ids
    table.target[: len(strings)] = [len(s) for s in strings]
    for row, t in enumerate(ids):
        table.length[row] = min(len(token_bytes[t]), width)
        for i, c in at.get(t, ()):
            table.at[row, i, c] = True
        for i, e in ends.get(t, ()):
            table.ends[row, i, e] = True
    return table


# No stop strings: no tokens and no strings, so that a program given it holds no
# matching (`holds_text_stops`).
NO_TEXT_STOPS = TextStops(
    ids=np.zeros((0,), np.int32),
    length=np.zeros((0,), np.int32),
    at=np.zeros((0, 0, 1), np.bool_),
    ends=np.zeros((0, 0, 2), np.bool_),
    target=np.zeros((0,), np.int32),
)
# The engine's slots: no stop strings, at the smallest shape (each decode call stacks them).
NO_TEXT_STOPS_TINY = text_stops([], [], floor=(1, 1, 1))


def ends_with_text(
    tokens: Int[Array, " max_len"], pos: Int[Array, ""], table: TextStops
) -> Bool[Array, ""]:
    """Whether the bytes of `tokens[: pos + 1]` end in a stop string of `table` that
    reaches into the token at `pos`."""
    size, _, width = table.at.shape
    back = pos - jnp.arange(width, dtype=pos.dtype)  # the last token first
    window = jnp.where(back >= 0, tokens[jnp.clip(back, 0, tokens.shape[0] - 1)], -1)
    row = jnp.clip(jnp.searchsorted(table.ids, window), 0, size - 1)
    hit = table.ids[row] == window
    length = jnp.where(hit, table.length[row], 0)
    ends = table.ends[row[0]] & hit[0]  # (strings, width + 1)
    e = jnp.arange(width + 1, dtype=length.dtype)
    # matched[k, e]: bytes matched once tokens 0..k (counting back) are in, for a match
    # whose last token holds the string's last e bytes.
    matched = e[None, :] + (jnp.cumsum(length) - length[0])[:, None]
    before = matched[:-1]  # what token k >= 1 must fit before
    at = table.at[row[1:]] & hit[1:, None, None]  # (width - 1, strings, width)
    index = jnp.broadcast_to(jnp.clip(before, 0, width - 1)[:, None, :], (width - 1,) + ends.shape)
    fits = jnp.take_along_axis(at, index, axis=-1) & (before < width)[:, None, :]
    alive = jnp.cumprod(fits.astype(jnp.int32), axis=0) > 0  # every token back to k fits
    target = jnp.asarray(table.target)[:, None]
    whole = ends & (e[None, :] >= target)  # the last token holds all the rest
    spans = ends[None] & alive & (matched[1:, None, :] >= target[None])
    return jnp.any(whole) | jnp.any(spans)


def host_ends_with_text(text: Sequence[int], table: TextStops) -> bool:
    """`ends_with_text` for a Python list: the uncached reference path's check, and the
    engine's finish reason. Only the last `width` tokens can take part in a match: they
    run in one compiled program per table shape, whatever the text's length."""
    width = np.shape(table.at)[-1]
    if not np.any(np.asarray(table.target) <= width):  # no stop string: no device work
        return False
    last = np.asarray(text[-width:], np.int32)
    window = np.zeros((width,), np.int32)
    window[: len(last)] = last
    return bool(_ends_with_text(window, np.int32(len(last) - 1), table))


_ends_with_text = jax.jit(ends_with_text)


def holds_text_stops(table: TextStops) -> bool:
    """Whether a table can hold a stop string at all: a static fact (its shape); a table
    of no strings (`NO_TEXT_STOPS`) is matched nowhere."""
    return np.shape(table.target)[-1] > 0


def text_stops_on(table: TextStops) -> Bool[Array, "*rows"]:
    """Whether `table` holds any stop string (for tables per row, each row's)."""
    width = jnp.shape(table.at)[-1]
    return jnp.any(jnp.asarray(table.target) <= width, axis=-1)


class StopStrings:
    """Stop strings for [`eqrope.generate`][], matched on the text its tokens spell.

    `generate` sees only token ids, so the strings come with the tokenizer that turns ids
    into bytes. [`eqrope.generate_text`][] builds this itself from its `stop` strings.

    **Arguments:**

    - `tokenizer`: an [`eqrope.Tokenizer`][] (anything with a `token_bytes()` method: the
      bytes each token id spells).
    - `strings`: the stop strings, each a non-empty `str`.

    Pass it as an entry of `generate`'s `stop` list, beside token-id sequences:
    `stop=[eqrope.StopStrings(tokenizer, ["\\n\\n", "User:"]), [50256]]`. A row ends after
    the token that completes a string (its whole last token is kept, as in transformers).
    Matching runs on UTF-8 bytes, across token boundaries and into the prompt; special
    tokens spell nothing, and a match never runs through one.

    Raises `ValueError` for a string no sequence of the tokenizer's tokens can spell.
    """

    def __init__(self, tokenizer, strings: Sequence[str] | str):  # tokenizer: checked below
        if isinstance(strings, str):
            strings = [strings]
        if not callable(getattr(tokenizer, "token_bytes", None)):
            raise TypeError(
                f"StopStrings(tokenizer, strings): tokenizer must be an eqrope.Tokenizer, got "
                f"{type(tokenizer).__name__}; read one with eqrope.Tokenizer.from_pretrained(path)."
            )
        strings = tuple(strings)
        for i, s in enumerate(strings):
            if not isinstance(s, str) or not s:
                raise ValueError(f"StopStrings: strings[{i}] = {s!r}; each stop string must be non-empty text.")
        if not strings:
            raise ValueError("StopStrings: strings is empty; pass at least one string, or no stop at all.")
        self.strings = strings
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer.token_bytes())
        self.table = _kept_table(tokenizer, strings, MIN_SHAPE)

    def __repr__(self) -> str:
        return f"StopStrings({list(self.strings)!r})"


def text_table(stop, floor: tuple[int, int, int] | None = None) -> TextStops:
    """The `TextStops` of the `StopStrings` entries of a checked `stop` list: one table for
    all of them (they must share a tokenizer), each size at least `MIN_SHAPE`, and
    `NO_TEXT_STOPS` without any; or, given a `floor` (the engine's slots hold one fixed
    shape), each size at least `floor`, with or without strings."""
    given = [s for s in stop or () if isinstance(s, StopStrings)]
    if not given:
        return NO_TEXT_STOPS if floor is None else text_stops([], [], floor)
    floor = MIN_SHAPE if floor is None else floor
    if len(given) == 1 and floor == MIN_SHAPE:
        return given[0].table
    if any(s.tokenizer is not given[0].tokenizer for s in given):
        raise ValueError(
            "stop holds StopStrings of different tokenizers; build them all with the model's "
            "tokenizer (or one StopStrings with every string)."
        )
    return _kept_table(given[0].tokenizer, tuple(t for s in given for t in s.strings), floor)


def _kept_table(tokenizer, strings: tuple[str, ...], floor: tuple[int, int, int]) -> TextStops:
    """The checked table of `strings` over `tokenizer`, kept with the tokenizer's latest
    tables (building one reads every token of the vocabulary)."""
    try:  # the tables of a tokenizer's latest strings, kept while it lives
        tables = _TABLES.setdefault(tokenizer, {})
    except TypeError:  # not weakly referenceable: no cache
        tables = {}
    if (strings, floor) not in tables:
        table = text_stops(tokenizer.token_bytes(), [s.encode() for s in strings], floor)
        _check_spelled(table, strings)
        if len(tables) >= _KEPT:
            del tables[next(iter(tables))]
        tables[strings, floor] = table
    return tables[strings, floor]


def _check_spelled(table: TextStops, strings: tuple[str, ...]) -> None:
    """A `ValueError` for a string whose last byte no token spells."""
    ends = np.asarray(table.ends).any(axis=(0, 2))
    for i, s in enumerate(strings):
        if not ends[i]:
            raise ValueError(
                f"StopStrings: no token of the tokenizer spells the end of {s!r}, so it can "
                "never match; check its characters against the tokenizer's vocabulary."
            )
