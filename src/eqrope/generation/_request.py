"""The arguments of `eqrope.generate`, checked once and gathered into a `Request`.

Everything here runs on the host before anything compiles, so a bad argument raises a
clear `TypeError`/`ValueError` naming it, and the compiled program sees only arrays.
"""

import dataclasses
import functools
from collections.abc import Callable

import jax
import numpy as np

from .._checks import check_int, is_concrete
from .._custom_types import IntLike
from ._generation_config import GenerationConfig, hashable
from ._request_checks import (
    UNDER_JIT,
    _check_draft,
    _check_fixed_rows,
    _check_ids,
    _check_key,
    _check_prompt,
    _max_len,
    _padded,
    has_cache_protocol,
)
from ._arrays import model_facts
from ._constraint import Constraint
from ._constraint_table import constraint_of
from ._per_row import row_configs, rows_sampling
from ._prefill import prefill_piece
from ._sampling import Sampling, per_row
from ._stop_strings import text_table
from ._stopping import stop_table


@dataclasses.dataclass(frozen=True)
class Request:
    """One checked `generate` call.

    - `batched`: the prompt was `(batch, seq)` (else `(seq,)`, held here as one row).
    - `prompt`: `(batch, seq)` int32 token ids; `lengths`: `(batch,)` real lengths.
    - `max_len`: the positions this call can hold: the cache rows of the cached path
      (see `cache_rows`); `max_new`: the most new tokens of any row.
    - `sampling`: the traced settings, the same for every row, or each row's (every
      field with a leading rows axis, `_sampling.per_row`); `key`: one typed PRNG key
      (rows derive theirs).
    - `pad_id`: fills positions after a row's end.
    - `samples`: `num_samples` (`None`: one sample per prompt, without its axis).
    - `stream`: the `on_token` callback, or `None`.
    - `program`: which program runs the call: `"cached"` (a model with the cache
      protocol), `"speculative"` (with a `draft`) or `"uncached"` (any causal callable).
    - `chunk`: the prefill chunk; `check_finite`: stop and raise on non-finite logits.
    - `draft`, `draft_len`, `accept`: the speculative settings (`None` without a draft).
    - `mesh`, `rules`: the device mesh and its sharding rules, or `None`.
    - `differentiable`: the model's arrays are being differentiated (`jax.grad`), so the
      loop must be a scan.
    - `row_max_new`: each prompt's `max_new` as asked (the cache may cut it),
      `(batch,)`, when given per row (else `None`: every row has `max_new`);
      `new_tokens()` gives the program's rows'.
    - `constraint`: the rows' automata table and start states
      (`_constraint.Constraint`), or `None` without any constraint.
    """

    batched: bool
    prompt: np.ndarray
    lengths: np.ndarray
    max_len: int
    max_new: int
    sampling: Sampling
    key: jax.Array
    pad_id: int
    samples: int | None = None
    stream: Callable[[int, int, int], object] | None = None
    program: str = "uncached"
    chunk: int = 64
    check_finite: bool = True
    draft: object = None
    draft_len: int | None = None
    accept: str | None = None
    mesh: object = None
    rules: object = None
    differentiable: bool = False
    row_max_new: np.ndarray | None = None
    constraint: Constraint | None = None

    def buffer(self) -> np.ndarray:
        """The prompts in `(batch, max_len)` rows, one column per cache row."""
        batch, seq = self.prompt.shape
        buffer = np.zeros((batch, self.max_len), np.int32)
        buffer[:, :seq] = self.prompt
        return buffer

    @property
    def rows(self) -> int:
        """The rows the program decodes: prompts times samples."""
        return self.prompt.shape[0] * (self.samples or 1)

    def new_tokens(self) -> np.ndarray:
        """The most new tokens of each row the program decodes, `(rows,)` int32
        (sample-minor): one array whether or not `max_new` was given per row, so both
        run one program."""
        per_prompt = self.row_max_new
        if per_prompt is None:
            per_prompt = np.full((self.prompt.shape[0],), self.max_new)
        per_prompt = np.minimum(per_prompt, self.max_len).astype(np.int32)  # the cache stops first
        return np.repeat(per_prompt, self.samples or 1)

    @property
    def total(self) -> int:
        """The width of the returned tokens: `min(seq + max_new, max_len)`."""
        return min(self.prompt.shape[1] + self.max_new, self.max_len)


def cache_rows(seq: int, max_new: int, model_max_len: int, max_len: IntLike | None) -> int:
    """The cache length of one `generate` call.

    `max_len=None` picks the smallest power of two (at least 16) that holds the prompt
    and `max_new` tokens, capped at the model's `max_len`: a 20-token job on a model built
    for 131072 positions gets 32 rows, and the program compiles once per power of two.
    An explicit `max_len` (at most the model's) pins one length, hence one program, for
    every call.
    """
    if max_len is None:
        wanted = max(16, seq + max_new)
        return min(1 << (wanted - 1).bit_length(), model_max_len)
    max_len = check_int(max_len, "max_len", minimum=1)
    if max_len > model_max_len:
        raise ValueError(
            f"max_len={max_len}, but the model's max_len is {model_max_len}; the cache "
            f"cannot hold more positions than the model. Pass at most {model_max_len}."
        )
    if max_len < seq:
        raise ValueError(
            f"max_len={max_len} cache rows cannot hold the prompt's {seq} tokens; pass "
            f"max_len >= {seq}, or None to size the cache from the prompt and max_new."
        )
    return max_len


def parse_request(
    model,
    prompt,
    settings: GenerationConfig,
    *,
    rows: dict[str, tuple] | None = None,
    max_len=None,
    key=None,
    prompt_lengths=None,
    stream=None,
    draft=None,
    draft_len=None,
    accept=None,
    check_finite=True,
    prefill_chunk="auto",
    mesh=None,
    rules=None,
    constraint=None,
    think_end=None,
    constraint_capacity=None,
) -> Request:
    """Check every argument of `generate` beside the model's arrays into a `Request`.

    `settings` is already checked (`GenerationConfig`), and so are the values given per
    row, `rows` (`_per_row.split_rows`); here come the checks that need the model: the
    prompt (one row per per-row value), the cache length, token ids below its
    `vocab_size`, the draft, and which program can run the call (`jax.grad`, a mesh,
    `on_token` and per-row settings each rule some out).
    """
    for name, value in (("prompt", prompt), ("prompt_lengths", prompt_lengths)):
        if not is_concrete(value):
            raise TypeError(UNDER_JIT.format(name=name))
    if stream is not None and not callable(stream):  # every path, the uncached one too
        raise TypeError(f"on_token must be a function (row, position, token), got {stream!r}.")
    model_max_len = _max_len(model)
    vocab = check_int(getattr(model, "vocab_size", None), "the model's vocab_size", minimum=1, none=True)
    batched, prompt, lengths = _check_prompt(prompt, prompt_lengths, model_max_len, vocab)
    facts = model_facts(model)
    _check_fixed_rows(facts.fixed_rows, batched, prompt.shape)
    rows = rows or {}
    configs = row_configs(settings, rows, batched, prompt.shape[0])
    wanted = [config.new_tokens(int(lengths.max())) for config in configs]
    cache = cache_rows(prompt.shape[1], max(wanted), model_max_len, max_len)
    max_new = min(max(wanted), cache)  # the cache stops the text first; keeps it an int32
    if any(config.temperature > 0 for config in configs) and key is None:
        raise ValueError("temperature > 0 samples at random; pass key=jax.random.key(...).")
    sampling, eos_ids = placed_sampling(settings, vocab)
    if rows.keys() - {"max_new"}:  # sampling settings per row: stacked
        sampling = rows_sampling([sampling_of(c, vocab)[0] for c in configs], settings.num_samples)
    pad_id = settings.pad_id
    if pad_id is None:
        pad_id = eos_ids[0] if eos_ids else 0
    key = _check_key(key)
    constraint = constraint_of(
        constraint, think_end, constraint_capacity, batch=prompt.shape[0], batched=batched,
        samples=settings.num_samples, vocab=vocab,
    )  # fmt: skip
    program = _check_program(
        model, facts.concrete, cache, sampling, stream, constraint, draft, draft_len, accept,
        check_finite, prefill_chunk, mesh, rules,
    )  # fmt: skip
    return Request(
        batched, prompt, lengths, cache, max_new, sampling, key, pad_id, settings.num_samples,
        stream, row_max_new=np.asarray(wanted) if "max_new" in rows else None,
        constraint=constraint, **program,
    )  # fmt: skip


def sampling_of(settings: GenerationConfig, vocab: int | None) -> tuple[Sampling, list[int]]:
    """The `Sampling` arrays of checked `settings` (ids checked against `vocab`), and the
    EOS ids. `generate` and the engine build a request's sampling record here alone."""
    eos_ids, bad_ids, stop = _check_ids(settings, vocab)
    limit = vocab if vocab is not None else np.iinfo(np.int32).max
    # A top_k of at least the vocabulary keeps everything, whatever its size.
    top_k = limit if settings.top_k is None else min(settings.top_k, limit)
    # NumPy scalars: `jnp.asarray` would dispatch a device op for each.
    sampling = Sampling(
        temperature=np.float32(settings.temperature),
        top_k=np.int32(top_k),
        top_p=np.float32(1.0 if settings.top_p is None else settings.top_p),
        eos=_padded(eos_ids),
        min_p=np.float32(settings.min_p or 0.0),
        repetition_penalty=np.float32(settings.repetition_penalty),
        presence_penalty=np.float32(settings.presence_penalty),
        frequency_penalty=np.float32(settings.frequency_penalty),
        min_new=np.int32(min(settings.min_new, np.iinfo(np.int32).max)),
        bad=_padded(bad_ids),
        stop=stop_table(stop),
        stop_text=text_table(settings.stop),
    )
    return sampling, eos_ids


def placed_sampling(settings: GenerationConfig, vocab: int | None) -> tuple[Sampling, tuple[int, ...]]:
    """`sampling_of`, with the arrays on the default device (uncommitted, so a program on
    a mesh or another device still takes them), kept per settings and vocabulary.

    A checked `GenerationConfig` is hashable and equal configs hold the same checked
    values: the same settings give the same arrays, so a repeated call skips the id checks
    and a copy to the device per array (about 0.1 ms of a 2.5 ms seed-protocol call). Settings that do
    not hash (a `StopStrings` of unhashable parts) are built every call.
    """
    return (_kept if hashable(settings) else _placed)(settings, vocab)


def _placed(settings: GenerationConfig, vocab: int | None) -> tuple[Sampling, tuple[int, ...]]:
    sampling, eos_ids = sampling_of(settings, vocab)
    return jax.device_put(sampling), tuple(eos_ids)


_kept = functools.lru_cache(maxsize=64)(_placed)


def _check_program(
    model, concrete, max_len, sampling, stream, constraint, draft, draft_len, accept, check_finite, chunk, mesh, rules
) -> dict:
    """The program that runs the call (a `Request`'s `program` and its settings, from
    `chunk` on), checked; `concrete`: every array of `model` has a value
    (`_arrays.model_facts`), `max_len` the call's cache rows."""
    if rules is not None and mesh is None:
        raise ValueError("rules say how to place arrays on a mesh; pass mesh= too.")
    draft, draft_len, accept = _check_draft(model, draft, draft_len, accept, max_len)
    cached = has_cache_protocol(model)
    if constraint is not None and (draft is not None or not cached):
        raise ValueError(
            "constraint= runs in the plain cached decode loop: "
            + ("pass draft=None (speculative decoding does not mask its drafts)." if cached else
               "pass a model with the cache protocol (init_cache, prefill, step), such as "
               "eqrope.RotaryDecoder, not an uncached callable.")
        )  # fmt: skip
    if not cached:
        if mesh is not None:
            raise ValueError("mesh is only for models with the cache protocol.")
        return dict(check_finite=bool(check_finite))
    if isinstance(chunk, str) and chunk == "auto":
        chunk = prefill_piece(max_len)
    else:
        chunk = min(check_int(chunk, "prefill_chunk", minimum=1), max_len)
    # Under `jax.grad` the model's arrays are tracers: the loop must be a scan.
    differentiable = not (concrete and all(map(is_concrete, jax.tree.leaves(draft))))
    if draft is not None:
        if per_row(sampling):
            raise ValueError(
                "per-row settings run without a draft; pass draft=None, or one value of each "
                "sampling setting for every row (max_new may still differ per row)."
            )
        if mesh is not None:
            raise ValueError("draft= does not run with mesh= yet; generate on a mesh without a draft.")
        if differentiable:
            raise ValueError(
                "draft= runs a while loop, which jax.grad cannot differentiate; take gradients "
                "of generate without a draft (the log-probabilities do not depend on it)."
            )
    elif stream is not None and (differentiable or mesh is not None):
        raise ValueError(
            "on_token streams from a plain generate call; it is not supported under "
            "jax.grad or with mesh=. Generate without on_token there."
        )
    return dict(
        program="cached" if draft is None else "speculative", chunk=chunk,
        check_finite=bool(check_finite), draft=draft, draft_len=draft_len, accept=accept,
        mesh=mesh, rules=rules, differentiable=differentiable,
    )  # fmt: skip
