"""Counting traces and XLA compiles from the test side, with `jax.monitoring` events.

The library keeps no counters of its own: JAX reports every trace and every backend
compile with the name of the function, and the tests listen.
"""

import collections
import contextlib

import jax.monitoring


_TRACE = "/jax/core/compile/jaxpr_trace_duration"
_COMPILE = "/jax/core/compile/backend_compile_duration"
_active: list["Compiles"] = []


class Compiles:
    """What was traced and compiled inside one `counting()` block, by function name."""

    def __init__(self):
        self.traces = collections.Counter()
        self.compiles = collections.Counter()


def _listen(event: str, duration: float, **kwargs) -> None:
    name = kwargs.get("fun_name")
    for record in _active:
        if event == _TRACE:
            record.traces[name] += 1
        elif event == _COMPILE:
            record.compiles[name] += 1


jax.monitoring.register_event_duration_secs_listener(_listen)


@contextlib.contextmanager
def counting():
    """`with counting() as c: ...` then `c.traces["generate_cached"]`, `c.compiles`."""
    record = Compiles()
    _active.append(record)
    try:
        yield record
    finally:
        _active.remove(record)
