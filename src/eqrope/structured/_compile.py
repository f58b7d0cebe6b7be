"""A regex compiled against a tokenizer's vocabulary into an `Automaton`, with outlines-core,
within a state budget, and cached.

outlines-core's `Vocabulary` maps each token's bytes to its ids and takes one EOS id.
Tokens that spell nothing (special tokens) are left out, so never allowed.

The end of the text is an END marker: the regex compiled is `(?:REGEX)` followed by the
character U+10FFFF, which a pseudo-token (id: the tokenizer's size) spells; a state may end
the text where END leads to a state where the regex matches (the export drops END's
transitions, and EOS's, the tokenizer's size + 1). outlines-core 0.2.14 keeps, out of a state where its regex matches,
only the tokens that lead to another such state (after `1`, `1(x5)?` could go on only with
a token `x5`); with END no state but the last matches, so nothing is lost.
"""

import collections
import functools
import hashlib
import threading
from collections.abc import Sequence

import numpy as np

from .._checks import check_int
from .._custom_types import IntLike
from ..generation._automaton import Automaton
from ._export import export


_EXTRA = 'pip install "eqrope[structured]"'
END = "\U0010ffff"
_CACHE_SIZE = 32
_cache: collections.OrderedDict = collections.OrderedDict()
_lock = threading.Lock()


def outlines_core():
    """The `outlines_core` module, or an `ImportError` that names the extra."""
    try:
        import outlines_core
    except ImportError as e:
        raise ImportError(
            f"structured output (eqrope.Regex, Choice, JsonSchema) needs outlines-core: {_EXTRA}"
        ) from e
    return outlines_core


@functools.cache
def _byte_vocabulary():
    """A vocabulary of the 256 single bytes (EOS id 256), for checks before the real build."""
    oc = outlines_core()
    return oc.Vocabulary(256, {bytes([b]): [b] for b in range(256)})


def ended(regex: str) -> str:
    """`regex` followed by the END marker."""
    return f"(?:{regex})\\x{{10ffff}}"


def byte_index(regex: str, what: str):
    """The outlines-core index of `ended(regex)` over single bytes; a `ValueError` naming
    `what` for a regex outlines-core cannot compile."""
    oc = outlines_core()
    try:
        return oc.Index(ended(regex), _byte_vocabulary())
    except (ValueError, RuntimeError) as e:
        raise ValueError(f"{what}: outlines-core cannot compile it ({e}).") from None


# Bytes a JSON string must escape: control characters, the quote, the backslash.
_UNSAFE = np.array(list(range(0x20)) + [ord('"'), ord("\\")])


def json_pattern_check(pattern: str, path: str) -> None:
    """Raise a `ValueError` when `pattern` (a JSON schema's string `pattern`) matches a
    character a JSON string must escape: the text would not be valid JSON."""
    index = byte_index(f"(?:{pattern})", f"JsonSchema: the pattern at {path}")
    used = {t for row in index.get_transitions().values() for t in row}
    bad = sorted(used.intersection(_UNSAFE.tolist()))
    if bad:
        raise ValueError(
            f"JsonSchema: the pattern at {path} can match {bytes(bad)!r}, which a JSON string "
            "must escape (a control character, a quote or a backslash); exclude them, e.g. "
            r'write [^"\\\x00-\x1f] for "any character" instead of ".".'
        )


def _vocabulary_key(token_bytes: Sequence[bytes]) -> str:
    digest = hashlib.sha256()
    for b in token_bytes:
        digest.update(len(b).to_bytes(4, "little"))
        digest.update(b)
    return digest.hexdigest()


@functools.lru_cache(maxsize=4)
def _vocabulary(key: str, token_bytes: tuple[bytes, ...]):
    oc = outlines_core()
    ids: dict[bytes, list[int]] = {}
    for i, b in enumerate(token_bytes):
        if b:
            ids.setdefault(b, []).append(i)
    ids.setdefault(END.encode(), []).append(len(token_bytes))
    return oc.Vocabulary(len(token_bytes) + 1, ids)


def compile_regex(regex: str, tokenizer, vocab: IntLike | None, max_states: int, what: str) -> Automaton:
    """`regex` (outlines-core's Rust syntax, matched whole) against `tokenizer`'s token
    bytes, as an `Automaton` over `vocab` ids (default: the tokenizer's size).

    Raises `ValueError` past `max_states` states (checked on the byte-level automaton
    first, whose states bound the token-level ones, so the costly build never starts).
    """
    token_bytes = tuple(tokenizer.token_bytes())
    size = len(token_bytes)
    name = f"{what}.compile: vocab (the model's vocabulary size, at least the tokenizer's {size})"
    vocab = size if vocab is None else check_int(vocab, name, minimum=size)
    key = (regex, _vocabulary_key(token_bytes), int(vocab), int(max_states))
    with _lock:
        if key in _cache:
            _cache.move_to_end(key)
            return _cache[key]
    bytewise = len(byte_index(regex, what).get_transitions())
    if bytewise > max_states:
        raise ValueError(
            f"{what}: the constraint needs about {bytewise} automaton states, past "
            f"max_states={max_states}; simplify it (fewer optional properties, shorter "
            "length bounds) or pass a larger max_states."
        )
    oc = outlines_core()
    try:
        index = oc.Index(ended(regex), _vocabulary(key[1], token_bytes))
    except (ValueError, RuntimeError) as e:
        raise ValueError(f"{what}: outlines-core cannot compile it against this tokenizer ({e}).") from None
    automaton, _ = export(index, int(vocab), end_id=size, eos_id=size + 1)
    if automaton.accepting.size > max_states:
        raise ValueError(
            f"{what}: the constraint needs {automaton.accepting.size} automaton states, past "
            f"max_states={max_states}; simplify it or pass a larger max_states."
        )
    for array in automaton[:-1]:
        array.flags.writeable = False  # shared by every caller of the cache
    with _lock:
        _cache[key] = automaton
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return automaton
