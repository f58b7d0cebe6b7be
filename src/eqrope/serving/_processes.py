"""One engine over several processes: process 0 decides, the others replay its device calls.

Under `jax.distributed`, a mesh spans the devices of every process, and every process must
run the same programs on the same arguments (JAX's multi-controller model). The engine's
host side (admission, pages, events) runs in process 0 only; its `Runner` is wrapped by
`lead`, which sends each call's NumPy arguments to the other processes before making it
(`multihost_utils.broadcast_one_to_all` of the pickled call, padded to a power of two of
bytes), and each other process runs `follow`, which makes the same calls on its own
`Runner` until process 0 calls `dismiss`. A call's results are read in process 0 alone;
on such a mesh the programs return them replicated (`_mesh_programs.py`).

    engine = eqrope.Engine(model, slots=8, mesh=eqrope.make_mesh(8, 1))  # every process
    if jax.process_index() == 0:
        lead(engine); engine.warmup(); out = engine.generate(prompts); dismiss(engine)
    else:
        follow(engine)
"""

import pickle

import jax
import numpy as np
from jax.experimental import multihost_utils


def _exchange(message=None):
    """`message` of process 0, in every process."""
    data = pickle.dumps(message) if jax.process_index() == 0 else b""
    n = int(multihost_utils.broadcast_one_to_all(np.asarray(len(data), np.int32)))
    buffer = np.zeros(1 << max(n - 1, 0).bit_length(), np.uint8)
    buffer[: len(data)] = np.frombuffer(data, np.uint8)
    return pickle.loads(np.asarray(multihost_utils.broadcast_one_to_all(buffer))[:n].tobytes())


class Leader:
    """Process 0's runner: each call goes to the other processes first. A start's logits,
    a device array, go as their row in the last prefill's results (which every process
    holds)."""

    def __init__(self, runner):
        self.runner, self._last = runner, ()

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def prefill(self, *args):
        _exchange(("prefill", args))
        self._last = self.runner.prefill(*args)
        return self._last

    def start(self, slot, logits, *args):
        row = next(i for i, x in enumerate(self._last) if x is logits)
        _exchange(("start", (slot, row, *args)))
        return self.runner.start(slot, logits, *args)

    def decode(self, *args):
        _exchange(("decode", args))
        return self.runner.decode(*args)

    def copy(self, pairs):
        _exchange(("copy", (list(pairs),)))
        self.runner.copy(pairs)

    def warmup(self, *args):
        _exchange(("warmup", args))
        return self.runner.warmup(*args)


def lead(engine) -> None:
    """In process 0: make `engine`'s device calls in every process (see above)."""
    if jax.process_index() != 0:
        raise RuntimeError("lead(engine) runs in process 0; the other processes call follow(engine).")
    if not isinstance(engine.runner, Leader):
        engine.runner = Leader(engine.runner)


def follow(engine, rebuild=None) -> None:
    """In every process but 0: make the calls process 0's `engine` makes, until `dismiss`.
    `rebuild()` builds the engine again when process 0 does (`leading`)."""
    if jax.process_index() == 0:
        raise RuntimeError("process 0 leads (lead(engine)); follow(engine) runs in the others.")
    runner, last = engine.runner, ()
    while True:
        name, args = _exchange()
        if name == "stop":
            return
        if name == "rebuild":
            if rebuild is None:
                raise RuntimeError("process 0 built its engine again; pass follow(engine, rebuild=...).")
            runner, last = rebuild().runner, ()
            continue
        if name == "prefill":
            last = runner.prefill(*args)
        elif name == "start":
            slot, row, *rest = args
            runner.start(slot, last[row], *rest)
        else:
            getattr(runner, name)(*args)


def leading(make_engine):
    """In process 0: `make_engine` that leads each engine it builds, and has the other
    processes build theirs again (`follow`'s `rebuild`) each time after the first."""
    built = []

    def make():
        if built:
            _exchange(("rebuild", ()))
        engine = make_engine()
        lead(engine)
        built.append(True)
        return engine

    return make


def dismiss(engine) -> None:
    """In process 0: end the other processes' `follow`."""
    lead(engine)
    _exchange(("stop", ()))
