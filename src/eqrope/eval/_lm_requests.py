"""What lm-eval asks of `eqrope.eval.LM`, answered with `eqrope.score` and `eqrope.generate`;
each function takes the `LM` (its model, tokenizer, batch sizes) and the requests.

- `loglikelihood_tokens`: requests that share a context share its prefill (`run_groups`): a
  four-choice question runs its context once and its four answers against the cache.
- `loglikelihood_rolling`: the windows of `lm_eval.utils.get_rolling_token_windows`
  (`context_len=1`), all requests' windows batched together.
- `generate_until`: one `eqrope.generate` program per batch, stopping at the EOS ids and at
  the `until` strings' tokens; the text is cut at the first `until` string, as the `hf`
  model cuts it.
"""

import logging
from collections import defaultdict

import jax
import numpy as np
from lm_eval.models.utils import handle_stop_sequences
from tqdm import tqdm

from ..generation._generate import generate
from ..generation._request import cache_rows
from ._prefix import Continuation, Group, run_groups
from ._windows import rolling_windows, run_pieces


eval_logger = logging.getLogger(__name__)

# Generation settings `generate_until` passes on to `eqrope.generate` (besides `until`,
# `max_gen_toks`, `do_sample` and `temperature`).
_GENERATE_KWARGS = ("top_k", "top_p", "min_p", "repetition_penalty")
# lm-eval's names for the most new tokens, first wins.
_MAX_NEW_ALIASES = ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")


# -- log-likelihoods ---------------------------------------------------------------------------


def loglikelihood_tokens(lm, requests, disable_tqdm: bool = False, override_bs=None):
    """Score `(request, context_ids, continuation_ids)` triples; requests with the same
    (truncated) context share one prefill."""
    window = lm.max_length
    groups: dict[tuple, list[int]] = defaultdict(list)
    rows = []
    for i, (request, context, continuation) in enumerate(requests):
        if not continuation:
            raise ValueError(
                f"lm-eval request {request!r} has an empty continuation (no tokens to score); "
                "check the task's target text."
            )
        if len(continuation) > window:
            raise ValueError(
                f"lm-eval request {request!r}: the continuation has {len(continuation)} "
                "tokens, "
                f"more than max_length={window}."
            )
        whole = list(context) + list(continuation)
        if len(whole) > window + 1:
            eval_logger.warning(
                f"Combined length of context ({len(context)}) and continuation "
                f"({len(continuation)}) exceeds the maximum length ({window}); truncating "
                f"{len(whole) - window - 1} tokens from the left."
            )
        whole = whole[-(window + 1) :]
        groups[tuple(whole[: -len(continuation)])].append(i)
        rows.append(np.asarray(continuation, np.int32))
    # The longest contexts first: the first pass is the largest (lm-eval's order).
    ordered = sorted(groups.items(), key=lambda item: (-len(item[0]), item[0]))
    work = [
        Group(np.asarray(c, np.int32), [Continuation(rows[i]) for i in members])
        for c, members in ordered
    ]
    longest = max((len(w.prefix) + max(len(r.ids) for r in w.rows) - 1 for w in work), default=1)
    per_pass = override_bs or lm._rows("loglikelihood", longest)
    results = [None] * len(requests)
    pbar = tqdm(
        total=len(requests),
        disable=disable_tqdm or lm.rank != 0,
        desc="Running loglikelihood requests",
    )
    for (g, k), logprobs, greedy in run_groups(
        lm.model,
        work,
        rows=per_pass,
        multiple=lm._multiple,
        mesh=lm.mesh,
        rules=lm.rules,
        on_pass=pbar.update,
    ):
        i = ordered[g][1][k]
        answer = (float(logprobs.sum(dtype=np.float64)), bool(greedy.all()))
        results[i] = answer
        if requests[i][0] is not None:
            lm.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
    pbar.close()
    return results


def loglikelihood_rolling(lm, requests, disable_tqdm: bool = False) -> list[float]:
    """The log-likelihood of each whole text after the prefix token, in the disjoint
    rolling windows of lm-eval's `hf` model (windows of `max_length` tokens, each
    token scored once)."""
    window = lm.max_length
    texts = [
        [lm.prefix_token_id, *lm.tok_encode(string)] for (string,) in (r.args for r in requests)
    ]
    pieces = [
        p
        for i, ids in enumerate(texts)
        for p in rolling_windows(i, len(ids), 1, window, window)
        if len(ids) > 1
    ]
    per_pass = lm._rows("loglikelihood_rolling", window)
    totals = np.zeros((len(texts),), np.float64)
    pbar = tqdm(
        total=len(pieces),
        disable=disable_tqdm or lm.rank != 0,
        desc="Running loglikelihood_rolling windows",
    )
    rows = [np.asarray(ids, np.int32) for ids in texts]
    for piece, logprobs, _ in run_pieces(
        lm.model,
        rows,
        pieces,
        rows=per_pass,
        window=window,
        multiple=lm._multiple,
        mesh=lm.mesh,
        rules=lm.rules,
        on_pass=pbar.update,
    ):
        totals[piece.row] += float(logprobs.sum(dtype=np.float64))
    pbar.close()
    out = [float(t) for t in totals]
    for (string,), total in zip((r.args for r in requests), out):
        lm.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
    return out


# -- generation --------------------------------------------------------------------------------


def generate_until(lm, requests, disable_tqdm: bool = False) -> list[str]:
    """Greedy (or sampled, with `do_sample=True`) text after each context, cut at the
    first `until` string; batches of `batch_size` prompts, longest first, one group of
    generation settings at a time."""
    results = [None] * len(requests)
    pbar = tqdm(
        total=len(requests),
        disable=disable_tqdm or lm.rank != 0,
        desc="Running generate_until requests",
    )
    by_settings: dict[str, list[int]] = defaultdict(list)
    for i, request in enumerate(requests):
        by_settings[repr(sorted(request.args[1].items()))].append(i)
    per_pass = lm._rows("generate_until", lm.max_length)
    eos_text = lm.tok_decode([lm.eot_token_id], skip_special_tokens=False)
    for members in by_settings.values():
        gen_kwargs = requests[members[0]].args[1]
        settings = _generation_settings(lm, gen_kwargs, eos_text)
        until, max_new = settings.pop("until"), settings.pop("max_new")
        keep = lm.max_length - max_new
        # An empty string is in every text: the hf model's stopping criterion (is the stop
        # string in the new text?) ends every row after its first token, whose text its
        # cut keeps (it skips ''). The context is cut to leave room for max_new alike.
        steps = 1 if "" in until else max_new
        prompts = {i: lm.tok_encode(requests[i].args[0])[-keep:] for i in members}
        order = sorted(members, key=lambda i: (-len(prompts[i]), requests[i].args[0]))
        # One cache length for the group (the longest prompt's), so one program.
        settings["max_len"] = cache_rows(len(prompts[order[0]]), steps, lm.model.max_len, None)
        for begin in range(0, len(order), per_pass):
            batch = order[begin : begin + per_pass]
            texts = _generate(lm, [prompts[i] for i in batch], until, steps, settings, per_pass)
            for i, text in zip(batch, texts):
                results[i] = text
                lm.cache_hook.add_partial("generate_until", requests[i].args, text)
            pbar.update(len(batch))
    pbar.close()
    return results


def _generation_settings(lm, gen_kwargs: dict, eos_text: str) -> dict:
    if not isinstance(gen_kwargs, dict):
        raise TypeError(
            f"generate_until expects a dict of generation settings, got {gen_kwargs!r}."
        )
    # lm-eval's `normalize_gen_kwargs` (0.4.10 on), written out for older versions:
    # the aliases of max_gen_toks, and do_sample implied by a positive temperature.
    kwargs = dict(gen_kwargs)
    until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
    aliases = [kwargs.pop(k, None) for k in _MAX_NEW_ALIASES]
    max_new = int(next((n for n in aliases if n is not None), lm.max_gen_toks))
    temperature = float(kwargs.pop("temperature", 0.0))
    do_sample = kwargs.pop("do_sample", None)
    do_sample = temperature > 0 if do_sample is None else bool(do_sample)
    if kwargs.pop("max_length", None) is not None:
        eval_logger.warning("`max_length` in generation kwargs is ignored; use `max_gen_toks`.")
    unknown = sorted(set(kwargs) - set(_GENERATE_KWARGS))
    if unknown:
        raise ValueError(
            f"generate_until: eqrope does not support the generation settings {unknown}; it "
            "takes until, max_gen_toks, do_sample, temperature and "
            f"{', '.join(_GENERATE_KWARGS)}."
        )
    if max_new >= lm.max_length:
        raise ValueError(
            f"max_gen_toks={max_new} leaves no room for the context in max_length={lm.max_length}."
        )
    if do_sample and temperature <= 0:
        raise ValueError("generate_until: do_sample=True needs temperature > 0.")
    return dict(kwargs, until=until, max_new=max_new, temperature=temperature if do_sample else 0.0)


def _generate(
    lm, prompts: list[list[int]], until: list[str], max_new: int, settings: dict, rows: int
) -> list[str]:
    """New text after each prompt, cut at the first `until` string.

    The `until` strings go to `generate` as token stops, which can end a row early only
    when its text holds the string (a stop whose tokens begin in the prompt can end
    it before the text does: such rows run again without stops).
    """
    stops = [
        ids for u in until if u for ids in [lm.tokenizer.encode(u, add_special_tokens=False)] if ids
    ]
    eos = list(lm.tokenizer.eos_ids)
    news = _generate_ids(lm, prompts, max_new, settings, eos, stops or None, rows)
    texts = [lm.tok_decode(new) for new in news]
    early = [
        j
        for j, new in enumerate(news)
        if stops
        and len(new) < max_new
        and not (new and new[-1] in eos)
        and not any(u and u in texts[j] for u in until)
    ]
    if early:
        again = _generate_ids(lm, [prompts[j] for j in early], max_new, settings, eos, None, rows)
        for j, new in zip(early, again):
            texts[j] = lm.tok_decode(new)
    return [_cut(text, until) for text in texts]


def _generate_ids(
    lm, prompts, max_new: int, settings: dict, eos: list[int], stops, rows: int
) -> list[list[int]]:
    """The new token ids of each prompt (its EOS id included), the batch padded to
    `rows` with copies of the last prompt so that a short batch does not compile anew."""
    rows = -(-max(rows, len(prompts)) // lm._multiple) * lm._multiple
    padded = prompts + [prompts[-1]] * (rows - len(prompts))
    lengths = np.asarray([len(p) for p in padded], np.int32)
    buffer = np.zeros((rows, int(lengths.max())), np.int32)
    for j, p in enumerate(padded):
        buffer[j, : len(p)] = p
    key = None
    if settings["temperature"] > 0:
        key = jax.random.fold_in(lm._key, lm._draws)
        lm._draws += 1
    extra = {k: settings[k] for k in _GENERATE_KWARGS if k in settings}
    result = generate(
        lm.model,
        buffer,
        max_new,
        prompt_lengths=lengths,
        eos_id=eos or None,
        stop=stops,
        temperature=settings["temperature"],
        key=key,
        max_len=settings["max_len"],
        return_logprobs=True,
        mesh=lm.mesh,
        rules=lm.rules,
        **extra,
    )
    tokens, ends = np.asarray(result.tokens), np.asarray(result.lengths)
    return [tokens[j, lengths[j] : ends[j]].tolist() for j in range(len(prompts))]


def _cut(text: str, until: list[str]) -> str:
    """`text` before the first of the `until` strings, as lm-eval's `hf` model cuts it
    (`postprocess_generated_text`: split at each non-empty string in turn)."""
    for term in until:
        if term:
            text = text.split(term)[0]
    return text
