"""`Runner`: the engine's device side (nano-vllm's `model_runner.py`).

It holds the model's arrays, the pool of pages and the slots' text, and runs the compiled
programs of `_programs.py` on NumPy arguments the scheduler built; nothing here decides
who runs. Each call hands the pool and the text to its program and takes them back (the
programs donate them, so they are updated in place).
"""

import jax
import numpy as np

from ..generation._arrays import split_model
from ..generation._sampling import stack_rows
from ._paged_cache import PagedCache
from ._programs import copy_program, decode_program, empty_text, prefill_program, start_program


class Runner:
    def __init__(self, model, *, slots: int, pages: int, page_size: int, max_len: int, chunk: int):
        config = model.config
        self.arrays, self.structure = split_model(model.unstacked())
        self.pool = PagedCache.empty(config, pages, page_size)
        self.text = empty_text(slots, max_len, config.vocab_size)
        self.chunk, self.max_len, self.vocab = chunk, max_len, config.vocab_size
        self.max_pages = max_len // page_size

    def prefill(self, tables, ids, starts, last, live):
        """One prefill call (`prefill_program`). **Returns:** the logits at each row's
        last prompt position, on the device."""
        self.pool, logits = prefill_program(
            self.arrays, self.pool, tables, ids, starts, last, live, structure=self.structure,
            chunk=self.chunk,
        )  # fmt: skip
        return logits

    def start(self, slot: int, logits, prompt: np.ndarray, sampling, key, max_new: int, check_finite):
        """Slot `slot` takes `prompt` and its first token (`start_program`). **Returns:**
        `(token, logprob, done, nonfinite)`, on the device."""
        row = np.zeros((self.max_len,), np.int32)
        row[: len(prompt)] = prompt
        one = jax.tree.map(lambda x: np.asarray(x)[None], sampling)
        self.text, first = start_program(
            self.text, np.int32(slot), logits, row, np.int32(len(prompt)), one, key,
            np.int32(max_new), check_finite,
        )  # fmt: skip
        return first

    def decode(self, rows, live, tables, sampling, keys, max_new, steps: int, exit_after: int, check_finite):
        """One chunk of decode steps (`decode_program`). **Returns:** the rows' `tokens`,
        `logprobs`, `pos`, `done` and `nonfinite`, on the host."""
        self.pool, self.text, view = decode_program(
            self.arrays, self.pool, self.text, np.asarray(rows, np.int32), live, tables, sampling,
            keys, max_new, np.int32(steps), np.int32(exit_after), check_finite,
            structure=self.structure, chunk=self.chunk,
        )  # fmt: skip
        return jax.device_get(view)

    def copy(self, pairs) -> None:
        """Page `target` becomes a copy of page `source`, for each `(source, target)`, one
        page per call (one program, whatever the number of samples)."""
        for source, target in pairs:
            self.pool = copy_program(self.pool, np.asarray([source], np.int32), np.asarray([target], np.int32))

    def warmup(self, prefill_shapes, decode_buckets, idle, check_finite) -> int:
        """Run every program once on inputs that write only the null page and a free
        slot's row. **Returns:** how many programs ran."""
        zeros = lambda *shape: np.zeros(shape, np.int32)
        for rows, size in prefill_shapes:
            self.prefill(zeros(rows, self.max_pages), zeros(rows, size), zeros(rows), zeros(rows),
                         np.zeros(rows, bool))  # fmt: skip
        self.start(0, np.zeros((self.vocab,), np.float32), zeros(1), idle, zeros(2).astype(np.uint32), 1, check_finite)
        for bucket in decode_buckets:
            self.decode(
                np.arange(bucket), np.zeros(bucket, bool), zeros(bucket, self.max_pages),
                stack_rows([idle] * bucket), zeros(bucket, 2).astype(np.uint32), zeros(bucket), 1, 1,
                check_finite,
            )  # fmt: skip
        self.copy([(0, 0)])
        jax.block_until_ready((self.pool, self.text))
        return len(prefill_shapes) + len(decode_buckets) + 2
