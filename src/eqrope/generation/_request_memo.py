"""The checked `Request` of a repeated `generate` call, kept for the next one.

A loop that calls `generate` again and again with the same model, prompt and settings
(many samples of one prompt under new keys, an evaluation, a benchmark) checks the same
arguments every time: about 0.1 ms of a 2.3 ms seed-protocol call on the CPU, host
work right after a program has run. `parse_request` is a pure function of its arguments,
so a call whose arguments are all immutable takes the `Request` the first such call
built, with its own `key`:

- the model: an `eqx.Module` whose arrays all have values (not under `jax.grad`), held by
  weak reference (`_arrays.model_facts` keeps its facts the same way);
- the prompt: a JAX array (immutable), held by weak reference; a NumPy array is read
  anew every call (it can change in place), and so is a list;
- the settings: a hashable `GenerationConfig` (numbers, `None`, tuples), no setting given
  per row, and none of `prompt_lengths`, `on_token`, `draft`, `mesh`, `rules`,
  `constraint` (each has its own checks against the arrays it brings).

Anything else is checked every call, as before. `_warn_if_cut` still warns every call.
"""

import collections
import dataclasses
import threading
import weakref

import equinox as eqx
import jax

from .._checks import is_concrete
from ._arrays import model_facts
from ._generation_config import GenerationConfig
from ._request import Request, parse_request
from ._request_checks import _check_key


# The arguments a kept request leaves out (`None`, or no per-row settings); the others
# (`max_len`, `check_finite`, `prefill_chunk`) may take any hashable value.
_ABSENT = (
    "rows", "prompt_lengths", "stream", "draft", "draft_len", "accept", "mesh", "rules",
    "constraint", "think_end", "constraint_capacity",
)  # fmt: skip
_KEPT_CALLS = 32
# key -> (weak reference to the model, weak reference to the prompt, the request), used
# from any thread under the lock
_KEPT: collections.OrderedDict = collections.OrderedDict()
_LOCK = threading.Lock()


def checked_request(model, prompt, settings: GenerationConfig, *, key=None, **arguments) -> Request:
    """`parse_request(model, prompt, settings, key=key, **arguments)`, kept per call
    signature when every argument is immutable (see the module's docstring)."""
    signature = _signature(model, prompt, settings, key is None, arguments)
    if signature is None:
        return parse_request(model, prompt, settings, key=key, **arguments)
    with _LOCK:
        kept = _KEPT.get(signature)
        if kept is not None:
            _KEPT.move_to_end(signature)
    if kept is not None and kept[0]() is model and kept[1]() is prompt:
        key = _check_key(key)
        return kept[2] if key is kept[2].key else dataclasses.replace(kept[2], key=key)
    request = parse_request(model, prompt, settings, key=key, **arguments)
    try:
        entry = (weakref.ref(model), weakref.ref(prompt), request)
    except TypeError:  # no weak references to this model: checked every call
        return request
    with _LOCK:
        _KEPT[signature] = entry
        if len(_KEPT) > _KEPT_CALLS:
            _KEPT.popitem(last=False)
    return request


def _signature(model, prompt, settings, keyless: bool, arguments: dict):
    """The key of a call whose arguments are all immutable, else `None`. Whether a `key`
    was passed is part of it (sampling without one is refused); the key itself is not."""
    if not (isinstance(prompt, jax.Array) and is_concrete(prompt) and isinstance(model, eqx.Module)):
        return None
    if arguments.get("rows") or any(arguments.get(name) is not None for name in _ABSENT[1:]):
        return None
    if not model_facts(model).concrete:
        return None
    rest = tuple((name, value) for name, value in arguments.items() if name not in _ABSENT)
    signature = (id(model), id(prompt), settings, keyless, rest)
    try:
        hash(signature)
    except TypeError:  # unhashable settings, max_len or prefill_chunk: checked every call
        return None
    return signature
