"""`Runner`: the engine's device side (nano-vllm's `model_runner.py`).

It holds the model's arrays, the pool of pages and the slots' text, and runs the compiled
programs of `_programs.py` (on a mesh, `_mesh_programs.py`'s) on NumPy arguments the
scheduler built; nothing here decides who runs. Each call hands the pool and the text to
its program and takes them back (the programs donate them, so they are updated in place).
The host names slots and pages by their engine-wide ids; a data shard's program takes
them as ids within its own part (`slot % S`, `page % P`: `_mesh_layout.py`).
"""

import jax
import jax.numpy as jnp
import numpy as np

from ..generation._arrays import split_model
from ..generation._sampling import stack_rows
from ._constraints import SlotConstraints
from ._mesh_programs import place_on_mesh
from ._paged_cache import PagedCache
from ._programs import ONE_DEVICE, empty_text


class Runner:
    def __init__(
        self, model, *, slots: int, pages: int, page_size: int, max_len: int, chunk: int, mesh=None, rules=None,
        shards: int = 1, constraints=None,
    ):  # fmt: skip
        config = model.config
        model = model.unstacked()
        self.pool = PagedCache.empty(config, pages, page_size)
        self.text = empty_text(slots, max_len, config.vocab_size)
        self.programs = ONE_DEVICE
        if mesh is not None:
            model, self.pool, self.text, self.programs = place_on_mesh(model, self.pool, self.text, mesh, rules)
        self.arrays, self.structure = split_model(model)
        self.chunk, self.max_len, self.vocab = chunk, max_len, config.vocab_size
        self.max_pages = max_len // page_size
        self.shards, self.slots_per_shard, self.pages_per_shard = shards, slots // shards, pages // shards
        # With the engine's `ConstraintBlocks`: each slot's automaton state (`_constraints.py`).
        self.constraints = constraints
        self.automata = None if constraints is None else jnp.zeros((slots,), jnp.int32)

    def _constraint(self):
        return None if self.constraints is None else SlotConstraints(self.constraints.device(), self.automata)

    def prefill(self, tables, ids, starts, last, live):
        """One prefill call (`prefill_program`). **Returns:** the logits at each row's
        last prompt position, on the device."""
        self.pool, logits = self.programs.prefill(
            self.arrays, self.pool, tables % self.pages_per_shard, ids, starts, last, live,
            structure=self.structure, chunk=self.chunk,
        )  # fmt: skip
        return logits

    def start(self, slot: int, logits, prompt: np.ndarray, sampling, key, max_new: int, check_finite, state=0):
        """Slot `slot` takes `prompt` and its first token (`start_program`), its automaton
        starting in `state` (with constraints). **Returns:** `(token, logprob, done,
        nonfinite)`, on the device."""
        row = np.zeros((self.max_len,), np.int32)
        row[: len(prompt)] = prompt
        one = jax.tree.map(lambda x: np.asarray(x)[None], sampling)
        constraint = self._constraint()
        out = self.programs.start(
            self.text, np.int32(slot), logits, row, np.int32(len(prompt)), one, key,
            np.int32(max_new), check_finite, *(() if constraint is None else (constraint, np.int32(state))),
        )  # fmt: skip
        self.text, first = out[:2]
        if constraint is not None:
            self.automata = out[2]
        return first

    def decode(self, rows, live, tables, sampling, keys, max_new, steps: int, exit_after: int, check_finite):
        """One chunk of decode steps (`decode_program`) over the slots `rows`, the same
        number of each shard's. **Returns:** the rows' `tokens`, `logprobs`, `pos`,
        `done` and `nonfinite`, on the host."""
        constraint = self._constraint()
        out = self.programs.decode(
            self.arrays, self.pool, self.text, np.asarray(rows, np.int32) % self.slots_per_shard, live,
            tables % self.pages_per_shard, sampling, keys, max_new, np.int32(steps), np.int32(exit_after),
            check_finite, *(() if constraint is None else (constraint,)), structure=self.structure,
            chunk=self.chunk,
        )  # fmt: skip
        self.pool, self.text, view = out[:3]
        if constraint is not None:
            self.automata = out[3]
        return jax.device_get(view)

    def copy(self, pairs) -> None:
        """Page `target` becomes a copy of page `source`, for each `(source, target)` (of
        one shard), one page per call (one program, whatever the number of samples)."""
        for source, target in pairs:
            sources, targets = np.zeros((2, self.shards), np.int32)
            shard = source // self.pages_per_shard
            sources[shard], targets[shard] = source % self.pages_per_shard, target % self.pages_per_shard
            self.pool = self.programs.copy(self.pool, sources, targets)

    def warmup(self, prefill_shapes, decode_rows, idle, check_finite) -> int:
        """Run every program once on inputs that write only the null pages and free
        slots' rows: prefills of each `(rows, size)`, decode chunks over each list of
        slots in `decode_rows`. **Returns:** how many programs ran."""
        zeros = lambda *shape: np.zeros(shape, np.int32)
        for rows, size in prefill_shapes:
            logits = self.prefill(zeros(rows, self.max_pages), zeros(rows, size), zeros(rows), zeros(rows),
                                  np.zeros(rows, bool))  # fmt: skip
        # The start takes a prefill's logits, placed as a request's will be.
        self.start(0, logits[0], zeros(1), idle, zeros(2).astype(np.uint32), 1, check_finite)
        for rows in decode_rows:
            n = len(rows)
            self.decode(
                rows, np.zeros(n, bool), zeros(n, self.max_pages), stack_rows([idle] * n),
                zeros(n, 2).astype(np.uint32), zeros(n), 1, 1, check_finite,
            )  # fmt: skip
        self.copy([(0, 0)])
        jax.block_until_ready((self.pool, self.text))
        return len(prefill_shapes) + len(decode_rows) + 2
