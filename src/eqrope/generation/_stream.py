"""Streaming: `on_token` called from inside the compiled loop, and text pieces from it.

The compiled program calls one module function, `_deliver`, through an ordered
`io_callback`, with a traced listener id; the id finds the call's `on_token` here. So a
new callback does not recompile, and a program compiled without streaming has no host
callback at all. Streaming stays a static setting (a program of its own) for that: a
program holding a host callback is never read back from the persistent compilation cache
(the callback's address is part of its key), and an `io_callback`'s effect takes every
call of a program off JAX's fast dispatch path (about 0.7 ms more per seed-protocol
call, measured). An exception raised by `on_token`, any `BaseException`
(`KeyboardInterrupt`, `SystemExit`, `GeneratorExit` too), stops the calls to it and is
raised again, itself, by `generate` once the program returns: none may escape into the
runtime, which would turn it into an `INTERNAL: CpuCallback error`.
"""

import contextlib
import itertools
import sys
from collections.abc import Callable, Iterator

import jax
import numpy as np
from jax.experimental import io_callback
from jaxtyping import Array, Bool, Int


class _Listener:
    def __init__(self, on_token: Callable[[int, int, int], object]):
        self.on_token = on_token
        self.error: BaseException | None = None


_LISTENERS: dict[int, _Listener] = {}
_NEXT = itertools.count()


@contextlib.contextmanager
def listening(on_token: Callable[[int, int, int], object]) -> Iterator[np.ndarray]:
    """Register `on_token` for one `generate` call; yields its id, an int32 scalar.

    On leaving (after the program's results were read), an exception that `on_token`
    raised, of any kind, is raised here: the caller gets the very exception object.
    """
    if not callable(on_token):
        raise TypeError(f"on_token must be a function (row, position, token), got {on_token!r}.")
    ident = next(_NEXT) % (2**31 - 1)
    listener = _LISTENERS[ident] = _Listener(on_token)
    try:
        yield np.int32(ident)
        jax.effects_barrier()
    finally:
        del _LISTENERS[ident]
    if listener.error is not None:
        raise listener.error


def streamed(run: Callable[[np.ndarray | None], object], on_token) -> object:
    """`run(stream_id)`: `run(None)` without `on_token`; with it, inside `listening`, the
    results ready before the listener is released."""
    if on_token is None:
        return run(None)
    with listening(on_token) as stream_id:
        return jax.block_until_ready(run(stream_id))


def _deliver(ident, tokens, positions, active) -> None:
    listener = _LISTENERS.get(int(ident))
    if listener is None or listener.error is not None:
        return
    try:
        for row in np.flatnonzero(active):
            listener.on_token(int(row), int(positions[row]), int(tokens[row]))
    except BaseException as e:  # noqa: BLE001 (Ctrl-C too: raised again by `listening`)
        listener.error = e


def emit(
    ident: Int[Array, ""], tokens: Int[Array, " rows"], positions: Int[Array, " rows"], active: Bool[Array, " rows"]
) -> None:
    """Inside the compiled loop: call the listener `ident` with each active row's token."""
    io_callback(_deliver, None, ident, tokens, positions, active, ordered=True)


class TextStream:
    """Token ids in, text pieces out, one row at a time, for `generate_text(stream=...)`.

    Incremental decoding (as vLLM's `detokenize_incrementally`): each token decodes a
    short window of the row's new ids, from the start of the last piece, and a piece is
    given out only when the window's text grows and does not end in U+FFFD, the
    replacement character of an incomplete UTF-8 sequence, so a multi-byte character
    split over several byte-level tokens comes out whole. A row stops at its first
    `eos_ids` token; `finish` gives out what the final text holds beyond the pieces.
    """

    def __init__(self, tokenizer, eos_ids, write: Callable[[int, str], object]):
        self.tokenizer, self.eos_ids, self.write = tokenizer, frozenset(eos_ids), write
        self.ids: dict[int, list[int]] = {}
        self.offsets: dict[int, tuple[int, int]] = {}
        self.shown: dict[int, str] = {}
        self.ended: set[int] = set()

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def on_token(self, row: int, position: int, token: int) -> None:
        if row in self.ended:
            return
        if token in self.eos_ids:
            self.ended.add(row)
            return
        ids = self.ids.setdefault(row, [])
        ids.append(token)
        start, read = self.offsets.get(row, (0, 0))
        before = self._decode(ids[start:read])
        text = self._decode(ids[start:])
        if len(text) > len(before) and not text.endswith("\ufffd"):
            self._put(row, text[len(before) :])
            self.offsets[row] = (read, len(ids))

    def finish(self, row: int, text: str) -> None:
        """The row's final text is `text`: give out the part not given yet."""
        shown = self.shown.get(row, "")
        if text.startswith(shown) and len(text) > len(shown):
            self._put(row, text[len(shown) :])

    def _put(self, row: int, piece: str) -> None:
        self.shown[row] = self.shown.get(row, "") + piece
        self.write(row, piece)


def print_piece(row: int, piece: str) -> None:
    """`stream=True`: the text of one prompt, on standard output as it comes."""
    sys.stdout.write(piece)
    sys.stdout.flush()
