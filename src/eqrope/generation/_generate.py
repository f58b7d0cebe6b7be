"""`eqrope.generate` in four steps: resolve the settings, check them into a `Request`,
run a program, build the result.

The settings' record is `_generation_config.py`; the checks, `_request.py`; the programs,
`_decode.py` (plain), `speculative/_round.py` and `_uncached.py` (the reference loop);
the result, `_result.py`.
"""

from collections.abc import Callable, Sequence
from typing import Any, Literal, overload

import numpy as np
from jaxtyping import Array, ArrayLike, Int

from .._custom_types import IntLike, PerRow
from .._log import warn
from ._decode import run_cached
from ._generation_config import FROM_CONFIG, GenerationConfig, _FromConfig, resolve
from ._hf_generation_config import refuse_hf_keywords
from ._per_row import refuse_config_list, split_rows
from ._request import Request
from ._request_memo import checked_request
from ._result import Generation, finish
from ._uncached import generate_uncached
from .speculative._round import run_speculative


class TruncationWarning(UserWarning):
    """`generate` was asked for more new tokens than the call's cache holds after the
    prompt: the text stops at the cache's last position. Pass a `max_new` that fits (the
    warning says how many) to silence it."""


# The types an editor sees: tokens, or a `Generation` with `return_logprobs=True`.
@overload
def generate(
    model, prompt, max_new: IntLike | PerRow | _FromConfig = ..., *, return_logprobs: Literal[False] = ...,
    **settings: Any,
) -> Int[Array, "*batch total"]: ...
@overload
def generate(
    model, prompt, max_new: IntLike | PerRow | _FromConfig = ..., *, return_logprobs: Literal[True], **settings: Any
) -> Generation: ...
@overload
def generate(
    model, prompt, max_new: IntLike | PerRow | _FromConfig = ..., *, return_logprobs: bool, **settings: Any
) -> Int[Array, "*batch total"] | Generation: ...


def generate(
    model,
    prompt,
    max_new: IntLike | PerRow | _FromConfig = FROM_CONFIG,
    *,
    config: GenerationConfig | None = None,
    max_len: IntLike | None = None,
    max_total: IntLike | None | _FromConfig = FROM_CONFIG,
    temperature: float | ArrayLike | PerRow | _FromConfig = FROM_CONFIG,
    top_k: IntLike | None | PerRow | _FromConfig = FROM_CONFIG,
    top_p: float | ArrayLike | None | PerRow | _FromConfig = FROM_CONFIG,
    min_p: float | ArrayLike | None | PerRow | _FromConfig = FROM_CONFIG,
    repetition_penalty: float | ArrayLike | PerRow | _FromConfig = FROM_CONFIG,
    presence_penalty: float | ArrayLike | PerRow | _FromConfig = FROM_CONFIG,
    frequency_penalty: float | ArrayLike | PerRow | _FromConfig = FROM_CONFIG,
    key=None,
    eos_id: IntLike | Sequence[IntLike] | ArrayLike | None | _FromConfig = FROM_CONFIG,
    stop: Sequence | None | _FromConfig = FROM_CONFIG,
    min_new: IntLike | PerRow | _FromConfig = FROM_CONFIG,
    bad_ids: Sequence[IntLike] | ArrayLike | None | _FromConfig = FROM_CONFIG,
    num_samples: IntLike | None | _FromConfig = FROM_CONFIG,
    prompt_lengths=None,
    pad_id: IntLike | None | _FromConfig = FROM_CONFIG,
    on_token: Callable[[int, int, int], object] | None = None,
    draft=None,
    draft_len: IntLike | None = None,
    accept: str | None = None,
    return_logprobs: bool = False,
    check_finite: bool = True,
    prefill_chunk: IntLike | Literal["auto"] = "auto",
    mesh=None,
    rules=None,
    constraint=None,
    think_end: Sequence[IntLike] | None = None,
    constraint_capacity: tuple[IntLike, IntLike] | None = None,
    **unknown,
) -> Int[Array, "*batch total"] | Generation:
    """Generate up to `max_new` tokens after `prompt`.

    **Arguments:**

    - `model`: a model with the cache protocol (`init_cache`, `prefill`, `step`, such as
      [`eqrope.RotaryDecoder`][]) takes the cached path: one compiled program that prefills
      the prompt in chunks and decodes in a `jax.lax.while_loop` that stops with the last
      row, the cache in its state (a `jax.lax.scan` under `jax.grad`). Any
      other causal callable `ids -> logits` with a `max_len` attribute takes the uncached
      path: the whole text runs again for every new token, padded on the right to the next
      power of two so that it compiles once per bucket, not once per length
      ([`eqrope.testing.Uncached`][] wraps a decoder so).
    - `prompt`: `(seq,)` token ids, or `(batch, seq)` for a batch.
    - `max_new`: the most tokens to add. Generation also stops when the text fills the
      cache (`max_len` positions), and, per row, after an `eos_id` or a `stop` sequence.
      A `max_new` that does not fit in the cache after the longest prompt warns with an
      [`eqrope.TruncationWarning`][] that says how many fit.
    - `config`: an [`eqrope.GenerationConfig`][] holding the settings below (`max_new`
      to `pad_id`); each of them not passed here takes the config's value, and without a
      config the defaults of `GenerationConfig()` (greedy, nothing else), shown in the
      signature as `FROM_CONFIG`. docs/generation.md compares them with transformers'.
    - `max_len`: the cache rows of this call, at most the model's `max_len`. The program
      compiles once per value. `None` picks the smallest power of two (at least 16) that
      holds the prompt and `max_new` tokens, capped at the model's `max_len`, so a short
      job on a model built for 131072 positions allocates a short cache; a new power of
      two compiles a new program (each compile is logged at INFO on the
      `eqrope.generation` logger, with its batch and cache length).
      `max_len=model.max_len` pins one program for every call (and lets generation run
      to the model's last position).
    - `max_total`: transformers' `max_length`, instead of `max_new`: the most tokens of
      a row, prompt and new tokens together; the call adds up to `max_total` minus the
      longest prompt (`prompt_lengths`' largest), and refuses a prompt of `max_total`
      tokens or more. Passing one of `max_new` and `max_total` replaces the config's other.
    - `temperature`, `top_k`, `top_p`, `min_p`: sampling; `temperature=0` (the default) is
      greedy. The logits are divided by the temperature, then truncated by top-k, top-p,
      then min-p (transformers' order); `None` turns a filter off.
    - `repetition_penalty`, `presence_penalty`, `frequency_penalty`: applied first, to the
      logits before the temperature, greedy or not: transformers' repetition penalty (over
      the prompt and the generated tokens, positive logits divided by it and negative
      ones multiplied), then OpenAI's presence and frequency penalties (over the
      generated tokens). Per-row counts are kept in the loop's state.
    - `key`: a PRNG key, needed when `temperature > 0`. The token at position `t` of a row
      is sampled with `jax.random.fold_in(row_key, t)`, where `row_key = key` for a 1-D
      prompt and `jax.random.split(key, batch)[i]` for row `i` of a batch, so row `i`
      equals `generate(model, prompt[i, :prompt_lengths[i]], ..., key=row_key)`. With
      `num_samples=n`, sample `j` of a row uses `jax.random.split(row_key, n)[j]`, so it
      equals `generate(model, that_prompt, ..., key=jax.random.split(row_key, n)[j])`.
    - `eos_id`: a row ends after this token, or after any of a sequence of tokens (the
      EOS token is kept).
    - `stop`: token-id sequences (`[[13, 13], [50256]]`); a row ends after the first
      complete match at the end of its text (the match may begin in the prompt; its
      tokens are kept).
    - `min_new`: EOS ids are masked out of a row's first `min_new` new tokens, and a stop
      sequence that ends among them does not end the row.
    - `bad_ids`: token ids that are never produced (masked before the temperature).
    - `num_samples`: `n` continuations of each prompt, sharing one prefill (the prompt's
      cache rows are copied to the `n` rows). The results gain an axis of `n` after the
      batch's: `(n, total)` for a 1-D prompt, `(batch, n, total)` for a batch.

      Every setting is a traced value: a new temperature, penalty, `min_p`, `min_new`,
      key or id list does not recompile. The shapes are static: the length of `eos_id`,
      the number of `bad_ids` (padded to 8, then to powers of two), the number of `stop`
      sequences and their longest length (each padded to 4, then to powers of two; no
      stop sequences, and likewise no `StopStrings`, is a shape of its own, whose program
      matches nothing: a first call with a stop compiles once more), and `num_samples`.

      Per row: `max_new`, `temperature`, `top_k`, `top_p`, `min_p`, the three penalties
      and `min_new` each also take a list, a tuple or a `(batch,)` array, one value per
      row of a `(batch, seq)` prompt (the samples of a row share its values). Row `i`
      then equals its prompt generated alone with its own values and its row key (see
      `key`). Each value is checked as one would be, named by its row
      (`temperature[2]`); new values of the same batch do not recompile, but sampling
      settings per row are a program of their own (`max_new` alone is not), and do not
      run with a `draft` (`max_new` per row does). Under `jax.vmap`, `generate` cannot
      run: pass the array instead.
    - `prompt_lengths`: for a batch, the real length of each row (ragged prompts, padded on
      the right); `None` means every row is full.
    - `pad_id`: fills positions after a row's end; default the (first) `eos_id`, else 0.
    - `on_token`: a function `on_token(row, position, token)` (three ints), called for
      each new token, in order, while the program runs: from inside the compiled loop
      through an ordered `jax.experimental.io_callback` (one call per row per step; rows
      in order). `row` indexes the flattened rows: `i * num_samples + j` for sample `j`
      of prompt `i`. With `None` the program holds no host callback. A new function does
      not recompile; an exception it raises is raised by `generate` when the program
      returns, and no further tokens are sent to it. Not under `jax.grad` nor `mesh`.
    - `draft`: speculative decoding (docs/speculative.md). A small model with the cache
      protocol and the model's vocabulary, or `"prompt_lookup"` (an
      [`eqrope.PromptLookup`][]: drafts copied from earlier in the text), proposes
      `draft_len` tokens (default 4) per round, and the model checks them all in one
      pass. The output is exact: greedy, the tokens are those of plain decoding; sampling,
      the text is distributed as plain sampling's under every setting above. The program
      compiles once per cache length and `draft_len`. Cached path only; not under
      `jax.grad` nor with `mesh`.
    - `accept`: the rule that keeps or replaces a drafted token when sampling:
      `"residual"` (the default; Leviathan et al. 2023) keeps the most drafts;
      `"coupled"` keeps a draft only when it equals the model's own draw with the key, so
      the text equals plain `generate`'s for the same key (see `eqrope.generation.speculative._acceptance`).
    - `return_logprobs`: return a [`eqrope.Generation`][] with both log-probabilities of
      each token: under the distribution it was sampled from, and under the model, and
      the counters `target_steps`, `drafted` and `accepted`.
    - `check_finite`: raise `FloatingPointError` if the model's logits for a row still
      generating hold a NaN or an infinity, instead of sampling garbage. Inside the
      compiled loop it costs one reduction per step: such a row stops and is flagged, and
      `generate` raises when the program returns. `False` skips the check.
    - `prefill_chunk`: the prompt is prefilled in chunks of this many tokens; only chunks
      that hold prompt tokens run. `"auto"` picks one size per cache length: a quarter of
      the call's cache rows, between 16 and 64.
    - `mesh`, `rules`: run a model placed with `eqrope.shard(model, mesh, rules)` on that
      device mesh (cached path only). The prompt rows, their lengths and keys are placed
      on the `batch` rule's mesh axis, and the cache is held with the sharding
      `eqrope.shard` gives a cache (by default batch on `"data"`, key/value heads on
      `"model"`); the results are replicated so every process can read them. The tokens
      are those of one device, and the program compiles once per mesh and rules.
    - `constraint`: structured output (docs/generation.md). An `Automaton` (a
      deterministic automaton over the model's token ids, such as `eqrope.structured`
      compiles from a regex, a choice list or a JSON schema with `vocab=model.vocab_size`)
      for every prompt, or a list with one per prompt of a batch (`None`: that row is
      free). Each row's logits are masked to its state's allowed tokens before every
      other processor (penalties, `bad_ids`, `min_new`, temperature, truncation), and its
      EOS ids are allowed exactly in accepting states; the `logprobs` returned are those
      of the masked distribution (`model_logprobs` stay the model's own). The state moves
      inside the compiled loop: no host call per token. A row left with no token (a
      final state without an EOS id, or whose last tokens `bad_ids` or `min_new` remove)
      ends there, with nothing added. Free rows are bitwise those of a call without
      `constraint`. The samples of a prompt share its constraint. Cached path only,
      without `draft`.
    - `think_end`: token ids that end a reasoning model's thinking: each constrained row
      starts free (but without EOS), and its constraint starts after the first
      occurrence of this sequence among its new tokens.
    - `constraint_capacity`: `(states, exceptions)` of the traced table that holds every
      constraint of the call (with one FREE state, and `len(think_end)` states per
      automaton with `think_end`); part of the program's shape. `None` picks the
      smallest powers of two that hold them, at least `(64, 1024)`, so new automata
      within that size compile nothing new; a value pins one program, and a call whose
      automata need more is refused, naming the size to pass.

    **Returns:** token ids of shape `(total,)` or `(batch, total)`, with
    `total = min(seq + max_new, max_len)` (the call's `max_len`; with the default it is
    `min(seq + max_new, model.max_len)`): each row holds its prompt (its first
    `prompt_lengths[i]` tokens), then its new tokens, then `pad_id` up to `total`. With
    `num_samples=n`: `(n, total)` or `(batch, n, total)`.

    **Refused** before anything compiles, with a `TypeError` or `ValueError` that names
    the argument: a prompt that is empty, of the wrong rank or dtype, longer than the
    model's `max_len`, or with ids outside the vocabulary; `prompt_lengths` outside
    `[1, seq]`; a `max_len` past the model's; a negative or NaN temperature and any
    setting outside its range (`eqrope.GenerationConfig`); ids of `eos_id`, `bad_ids`,
    `stop` or `pad_id` outside the vocabulary, an id both banned and an EOS, `bad_ids`
    that leave no token (also counting the EOS ids while `min_new` masks them); a
    sampling temperature without `key`; a `draft` that does not fit the model; `rules`
    without `mesh`; `on_token` that is not a function, or with `jax.grad` or `mesh`; a
    keyword of transformers' `generate` (`max_new_tokens`, `do_sample`,
    `num_return_sequences`, ...), with a `TypeError` that names eqrope's (the table of
    docs/generation.md), and any other unknown keyword. An exception raised by
    `on_token`, `KeyboardInterrupt` included, is raised by `generate` itself once the
    program returns.

    The cached path is differentiable: `jax.grad` of `generate(...).logprobs.sum()` with
    respect to the model's floating-point arrays gives the policy gradient of the sampled
    text (the tokens themselves are not differentiable).
    """
    refuse_hf_keywords(unknown, "generate", unknown=True)
    refuse_config_list(config)
    given, rows = split_rows(
        dict(
            max_new=max_new, max_total=max_total, temperature=temperature, top_k=top_k,
            top_p=top_p, min_p=min_p,
            repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty, eos_id=eos_id, pad_id=pad_id, stop=stop,
            min_new=min_new, bad_ids=bad_ids, num_samples=num_samples,
        ),
    )  # fmt: skip
    # The first row's values stand for the per-row settings in the call's settings.
    settings = resolve(config, {**given, **{name: values[0] for name, values in rows.items()}})
    request = checked_request(
        model, prompt, settings, rows=rows, max_len=max_len, key=key, prompt_lengths=prompt_lengths,
        stream=on_token, draft=draft, draft_len=draft_len, accept=accept,
        check_finite=check_finite, prefill_chunk=prefill_chunk, mesh=mesh, rules=rules,
        constraint=constraint, think_end=think_end, constraint_capacity=constraint_capacity,
    )  # fmt: skip
    _warn_if_cut(settings, request, max_len is not None)
    outputs = _PROGRAMS[request.program](model, request)
    return finish(request, outputs, return_logprobs)


def _warn_if_cut(settings: GenerationConfig, request: Request, explicit: bool) -> None:
    """Warn when the cache stops a row before its `max_new` tokens (the cut is documented,
    but a newcomer's `generate(model, prompt, 300)` on a 256-position model is a slip)."""
    cache = f"max_len={request.max_len}" if explicit else f"the model's max_len ({request.max_len})"
    if request.row_max_new is not None:  # per row: each row's own prompt and max_new
        fits = request.max_len - request.lengths
        cut = np.flatnonzero(request.row_max_new > fits)
        if not cut.size:
            return
        i = int(cut[0])
        wanted, fits, others = int(request.row_max_new[i]), int(fits[i]), cut.size - 1
        more = f" ({others} more row{'s' * (others != 1)} cut too)" if others else ""
        asked, prompt, fix = f"max_new[{i}]={wanted}", f"prompt of {request.lengths[i]} in row {i}", f"max_new[{i}]"
    else:
        longest = int(request.lengths.max())
        fits, wanted, more, fix = request.max_len - longest, settings.new_tokens(longest), "", "max_new"
        if wanted <= fits:
            return
        asked = f"max_new={wanted}"
        if settings.max_new is None:
            asked = f"max_total={settings.max_total} ({wanted} new tokens)"
        prompt = f"{'longest ' if request.prompt.shape[0] > 1 else ''}prompt of {longest}"
    warn(
        f"generate: {asked}, but {cache} holds {fits} new token{'s' * (fits != 1)} "
        f"after the {prompt}, so {wanted - fits} will not be generated{more}. Pass {fix} <= "
        f"{fits} to silence this.",
        TruncationWarning,
    )


# Each runs its compiled program (or the reference loop) and returns its `Outputs`.
_PROGRAMS = {"cached": run_cached, "speculative": run_speculative, "uncached": generate_uncached}
