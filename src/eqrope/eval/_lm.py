"""`eqrope.eval.LM`: eqrope as a model of EleutherAI's lm-evaluation-harness, named "eqrope".

lm-eval asks a model three things (`lm_eval.api.model.LM`): the log-likelihood of a
continuation after a context, the log-likelihood of a whole text (in rolling windows), and
text generated until a stop string. This class answers them with `eqrope.score` and
`eqrope.generate`, and tokenizes as lm-eval's `hf` model does (`TemplateLM`), so that the
same checkpoint gives the same requests and the same answers.

- `loglikelihood`: requests that share a context share its prefill (`run_groups`): a
  four-choice question runs its context once and its four answers against the cache.
- `loglikelihood_rolling`: the windows of `lm_eval.utils.get_rolling_token_windows`
  (`context_len=1`), all requests' windows batched together.
- `generate_until`: one `eqrope.generate` program per batch, stopping at the EOS ids and at
  the `until` strings' tokens; the text is cut at the first `until` string, as the `hf`
  model cuts it.

This module imports lm-eval; `eqrope.eval` imports it only when `LM` is asked for.
"""

import logging
import os
from collections import defaultdict

import jax
import jinja2
import numpy as np
from lm_eval.api.model import TemplateLM

# The built-in models are registered (lazily) before ours: lm-eval's `get_model` imports
# them only while its registry is empty.
import lm_eval.models  # noqa: F401
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences
from lm_eval.utils import simple_parse_args_string
from tqdm import tqdm

from .._checks import check_int
from ..generation._generate import generate
from ..generation._request import cache_rows
from ..model import count_params
from ..sharding._mesh import mesh_size
from ..sharding._rules import ShardingRules
from ..text import Tokenizer
from ..weights import from_hf
from ._score import (
    Continuation,
    Group,
    bucket,
    rolling_windows,
    rows_that_fit,
    run_groups,
    run_pieces,
)


eval_logger = logging.getLogger(__name__)

# Generation settings `generate_until` passes on to `eqrope.generate` (besides `until`,
# `max_gen_toks`, `do_sample` and `temperature`).
_GENERATE_KWARGS = ("top_k", "top_p", "min_p", "repetition_penalty")
# lm-eval's names for the most new tokens, first wins.
_MAX_NEW_ALIASES = ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")


@register_model("eqrope")
class LM(TemplateLM):
    """An eqrope model and tokenizer as an lm-eval model (`--model eqrope`).

    **Arguments** (as `--model_args key=value,...` on the command line):

    - `pretrained`: a Hugging Face checkpoint directory (read with [`eqrope.from_hf`][]
      and [`eqrope.Tokenizer.from_pretrained`][]), or a model in memory, such as a
      [`eqrope.RotaryDecoder`][] being trained (then pass `tokenizer`).
    - `tokenizer`: a directory, an [`eqrope.Tokenizer`][], or `None` for `pretrained`'s.
    - `dtype`: the model's dtype when read (`"float32"`, `"bfloat16"`, ...); `None` or
      `"auto"` keeps the checkpoint's.
    - `batch_size`: rows per compiled pass (an int), or `"auto"`: the most rows (a power of
      two, at most `max_batch_size`) whose scoring pass at the requests' length fits the
      memory budget, from XLA's memory analysis of the compiled pass (see
      `eqrope.eval._score.rows_that_fit`). `"auto:N"` is read as `"auto"`.
    - `max_batch_size`: the cap of `"auto"`.
    - `max_length`: the most tokens a pass reads (default the model's `max_len`); longer
      requests are cut on the left, as lm-eval's `hf` model cuts them.
    - `max_gen_toks`: the default most new tokens of `generate_until` (256, as `hf`).
    - `device`: `None` (JAX's default device), `"cpu"`, `"cuda"`, `"cuda:N"`, `"gpu"` or
      `"tpu"`; a platform JAX does not have falls back to the default with a warning
      (lm-eval's command line passes `cuda:0` unless told otherwise).
    - `seed`: the PRNG seed of sampled generation (`do_sample=True`).
    - `prefix_token_id`: the token before an empty context and before a rolling text
      (default the BOS token, else the first EOS id, as `hf`).
    - `add_bos_token`: `None` follows the tokenizer's post-processor; `True`/`False`
      forces special tokens on or off, as `hf`'s argument of that name.
    - `mesh`, `rules`: a mesh and sharding rules for a model placed with `eqrope.shard`
      (Python only).
    """

    def __init__(
        self,
        pretrained=None,
        tokenizer=None,
        *,
        dtype: str | None = None,
        batch_size: int | str = 1,
        max_batch_size: int | None = 64,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        device: str | None = None,
        seed: int = 1234,
        prefix_token_id: int | None = None,
        add_bos_token: bool | None = None,
        mesh=None,
        rules: ShardingRules | None = None,
        **unknown,
    ):
        super().__init__()
        if unknown:
            raise TypeError(
                f"eqrope's lm-eval model got unknown arguments {sorted(unknown)}; it takes "
                "pretrained, tokenizer, dtype, batch_size, max_batch_size, max_length, "
                "max_gen_toks, device, seed, prefix_token_id, add_bos_token (docs/evaluation.md "
                "sets them against lm-eval's hf model)."
            )
        if pretrained is None:
            raise TypeError(
                "eqrope's lm-eval model needs pretrained=a checkpoint directory or a model."
            )
        in_memory = not isinstance(pretrained, (str, os.PathLike))
        if in_memory and tokenizer is None:
            raise TypeError(
                "pretrained is a model in memory; pass tokenizer= too (a directory or an "
                "eqrope.Tokenizer)."
            )
        dtype = None if dtype in (None, "auto") else dtype
        if in_memory and dtype is not None:
            raise ValueError(
                "dtype= converts a checkpoint as it is read; convert a model in memory yourself."
            )
        model = pretrained if in_memory else from_hf(pretrained, dtype=dtype)
        self._device = _pick_device(device)
        if self._device is not None:
            model = jax.device_put(model, self._device)
        self.model = model
        self.pretrained = str(pretrained) if not in_memory else type(pretrained).__name__
        if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)):
            source = pretrained if tokenizer is None else tokenizer
            self._tokenizer_source = str(source)
            tokenizer = Tokenizer.from_pretrained(source)
        elif isinstance(tokenizer, Tokenizer):
            self._tokenizer_source = "eqrope.Tokenizer"
        else:
            raise TypeError(
                "tokenizer must be a directory or an eqrope.Tokenizer, got "
                f"{type(tokenizer).__name__}."
            )
        if tokenizer.vocab_size > model.vocab_size:
            raise ValueError(
                f"the tokenizer has {tokenizer.vocab_size} ids but the model's vocab_size is "
                f"{model.vocab_size}; pass the model's own tokenizer."
            )
        self.tokenizer = tokenizer
        self._max_length = (
            model.max_len if max_length is None else check_int(max_length, "max_length", minimum=2)
        )
        if self._max_length > model.max_len:
            raise ValueError(
                f"max_length={self._max_length}, but the model's max_len is {model.max_len}; "
                f"pass at most {model.max_len}."
            )
        self._max_gen_toks = check_int(max_gen_toks, "max_gen_toks", minimum=1)
        self.batch_size_per_gpu = _check_batch_size(batch_size)
        self.max_batch_size = check_int(
            64 if max_batch_size is None else max_batch_size, "max_batch_size", minimum=1
        )
        self.batch_sizes = {}  # the sizes "auto" chose, by request type (lm-eval reports them)
        self.custom_prefix_token_id = prefix_token_id
        self.add_bos_token = add_bos_token
        self.mesh, self.rules = mesh, rules
        self._multiple = 1 if mesh is None else mesh_size(mesh, (rules or ShardingRules()).batch)
        self._key = jax.random.key(check_int(seed, "seed"))
        self._draws = 0

    # -- construction from lm-eval's arguments --------------------------------------------------

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> "LM":
        """`--model_args k=v,...`; a `batch_size` there wins over `--batch_size` (whose
        default, 1, lm-eval always passes)."""
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> "LM":
        extra = {
            k: v
            for k, v in (additional_config or {}).items()
            if v is not None and k not in arg_dict
        }
        return cls(**arg_dict, **extra)

    # -- what lm-eval reads ------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        if not self.tokenizer.eos_ids:
            raise ValueError(
                "the tokenizer names no EOS token (eos_token in tokenizer_config.json)."
            )
        return self.tokenizer.eos_ids[0]

    @property
    def prefix_token_id(self) -> int:
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        bos = self.tokenizer.special_tokens.get("bos_token")
        bos_id = None if bos is None else self.tokenizer.tokenizer.token_to_id(bos)
        return self.eot_token_id if bos_id is None else bos_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self):
        return self.batch_size_per_gpu

    @property
    def tokenizer_name(self) -> str:
        return self._tokenizer_source.replace("/", "__")

    def get_model_info(self) -> dict:
        return {
            "model_num_parameters": count_params(self.model),
            "model_dtype": self.model.config.dtype if hasattr(self.model, "config") else "",
        }

    # -- tokens ------------------------------------------------------------------------------

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, left_truncate_len=None, **kwargs
    ) -> list[int]:
        """The token ids of `string`, with special tokens as lm-eval's `hf` model adds them:
        the post-processor's (a BOS token) unless `add_bos_token` says otherwise or the
        string already starts with the prefix token's text."""
        special = add_special_tokens
        if special is None:
            special = True if self.add_bos_token is None else self.add_bos_token
            if string.startswith(self.tokenizer.decode([self.prefix_token_id])):
                special = False
        ids = self.tokenizer.encode(string, add_special_tokens=special)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(
            list(np.atleast_1d(tokens)), skip_special_tokens=skip_special_tokens
        )

    # -- log-likelihoods -----------------------------------------------------------------------

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
        """Score `(request, context_ids, continuation_ids)` triples; requests with the same
        (truncated) context share one prefill."""
        window = self.max_length
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
        longest = max(
            (len(w.prefix) + max(len(r.ids) for r in w.rows) - 1 for w in work), default=1
        )
        per_pass = override_bs or self._rows("loglikelihood", longest)
        results = [None] * len(requests)
        pbar = tqdm(
            total=len(requests),
            disable=disable_tqdm or self.rank != 0,
            desc="Running loglikelihood requests",
        )
        for (g, k), logprobs, greedy in run_groups(
            self.model,
            work,
            rows=per_pass,
            multiple=self._multiple,
            mesh=self.mesh,
            rules=self.rules,
            on_pass=pbar.update,
        ):
            i = ordered[g][1][k]
            answer = (float(logprobs.sum(dtype=np.float64)), bool(greedy.all()))
            results[i] = answer
            if requests[i][0] is not None:
                self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
        pbar.close()
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The log-likelihood of each whole text after the prefix token, in the disjoint
        rolling windows of lm-eval's `hf` model (windows of `max_length` tokens, each
        token scored once)."""
        window = self.max_length
        texts = [
            [self.prefix_token_id, *self.tok_encode(string)]
            for (string,) in (r.args for r in requests)
        ]
        pieces = [
            p
            for i, ids in enumerate(texts)
            for p in rolling_windows(i, len(ids), 1, window, window)
            if len(ids) > 1
        ]
        per_pass = self._rows("loglikelihood_rolling", window)
        totals = np.zeros((len(texts),), np.float64)
        pbar = tqdm(
            total=len(pieces),
            disable=disable_tqdm or self.rank != 0,
            desc="Running loglikelihood_rolling windows",
        )
        rows = [np.asarray(ids, np.int32) for ids in texts]
        for piece, logprobs, _ in run_pieces(
            self.model,
            rows,
            pieces,
            rows=per_pass,
            window=window,
            multiple=self._multiple,
            mesh=self.mesh,
            rules=self.rules,
            on_pass=pbar.update,
        ):
            totals[piece.row] += float(logprobs.sum(dtype=np.float64))
        pbar.close()
        out = [float(t) for t in totals]
        for (string,), total in zip((r.args for r in requests), out):
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
        return out

    # -- generation ----------------------------------------------------------------------------

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, with `do_sample=True`) text after each context, cut at the
        first `until` string; batches of `batch_size` prompts, longest first, one group of
        generation settings at a time."""
        results = [None] * len(requests)
        pbar = tqdm(
            total=len(requests),
            disable=disable_tqdm or self.rank != 0,
            desc="Running generate_until requests",
        )
        by_settings: dict[str, list[int]] = defaultdict(list)
        for i, request in enumerate(requests):
            by_settings[repr(sorted(request.args[1].items()))].append(i)
        per_pass = self._rows("generate_until", self.max_length)
        eos_text = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        for members in by_settings.values():
            gen_kwargs = requests[members[0]].args[1]
            settings = self._generation_settings(gen_kwargs, eos_text)
            until, max_new = settings.pop("until"), settings.pop("max_new")
            keep = self.max_length - max_new
            prompts = {i: self.tok_encode(requests[i].args[0])[-keep:] for i in members}
            order = sorted(members, key=lambda i: (-len(prompts[i]), requests[i].args[0]))
            # One cache length for the group (the longest prompt's), so one program.
            settings["max_len"] = cache_rows(
                len(prompts[order[0]]), max_new, self.model.max_len, None
            )
            for begin in range(0, len(order), per_pass):
                batch = order[begin : begin + per_pass]
                texts = self._generate(
                    [prompts[i] for i in batch], until, max_new, settings, per_pass
                )
                for i, text in zip(batch, texts):
                    results[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                pbar.update(len(batch))
        pbar.close()
        return results

    def _generation_settings(self, gen_kwargs: dict, eos_text: str) -> dict:
        if not isinstance(gen_kwargs, dict):
            raise TypeError(
                f"generate_until expects a dict of generation settings, got {gen_kwargs!r}."
            )
        # lm-eval's `normalize_gen_kwargs` (0.4.10 on), written out for older versions:
        # the aliases of max_gen_toks, and do_sample implied by a positive temperature.
        kwargs = dict(gen_kwargs)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
        aliases = [kwargs.pop(k, None) for k in _MAX_NEW_ALIASES]
        max_new = int(next((n for n in aliases if n is not None), self.max_gen_toks))
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
        if max_new >= self.max_length:
            raise ValueError(
                f"max_gen_toks={max_new} leaves no room for the context in "
                f"max_length={self.max_length}."
            )
        if do_sample and temperature <= 0:
            raise ValueError("generate_until: do_sample=True needs temperature > 0.")
        return dict(
            kwargs, until=until, max_new=max_new, temperature=temperature if do_sample else 0.0
        )

    def _generate(
        self, prompts: list[list[int]], until: list[str], max_new: int, settings: dict, rows: int
    ) -> list[str]:
        """New text after each prompt, cut at the first `until` string.

        The `until` strings go to `generate` as token stops, which can end a row early only
        when its text holds the string (a stop whose tokens begin in the prompt can end
        it before the text does: such rows run again without stops).
        """
        stops = [
            ids
            for u in until
            if u
            for ids in [self.tokenizer.encode(u, add_special_tokens=False)]
            if ids
        ]
        eos = list(self.tokenizer.eos_ids)
        news = self._generate_ids(prompts, max_new, settings, eos, stops or None, rows)
        texts = [self.tok_decode(new) for new in news]
        early = [
            j
            for j, new in enumerate(news)
            if stops
            and len(new) < max_new
            and not (new and new[-1] in eos)
            and not any(u and u in texts[j] for u in until)
        ]
        if early:
            again = self._generate_ids(
                [prompts[j] for j in early], max_new, settings, eos, None, rows
            )
            for j, new in zip(early, again):
                texts[j] = self.tok_decode(new)
        return [_cut(text, until) for text in texts]

    def _generate_ids(
        self, prompts, max_new: int, settings: dict, eos: list[int], stops, rows: int
    ) -> list[list[int]]:
        """The new token ids of each prompt (its EOS id included), the batch padded to
        `rows` with copies of the last prompt so that a short batch does not compile anew."""
        rows = -(-max(rows, len(prompts)) // self._multiple) * self._multiple
        padded = prompts + [prompts[-1]] * (rows - len(prompts))
        lengths = np.asarray([len(p) for p in padded], np.int32)
        buffer = np.zeros((rows, int(lengths.max())), np.int32)
        for j, p in enumerate(padded):
            buffer[j, : len(p)] = p
        key = None
        if settings["temperature"] > 0:
            key = jax.random.fold_in(self._key, self._draws)
            self._draws += 1
        extra = {k: settings[k] for k in _GENERATE_KWARGS if k in settings}
        result = generate(
            self.model,
            buffer,
            max_new,
            prompt_lengths=lengths,
            eos_id=eos or None,
            stop=stops,
            temperature=settings["temperature"],
            key=key,
            max_len=settings["max_len"],
            return_logprobs=True,
            mesh=self.mesh,
            rules=self.rules,
            **extra,
        )
        tokens, ends = np.asarray(result.tokens), np.asarray(result.lengths)
        return [tokens[j, lengths[j] : ends[j]].tolist() for j in range(len(prompts))]

    # -- chat templates ------------------------------------------------------------------------

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The conversation rendered with the tokenizer's chat template, as lm-eval's `hf`
        model renders it: `add_generation_prompt=False` continues the last message
        (transformers' `continue_final_message`), and a template that refuses a system
        message is tried again without it."""
        try:
            return self._render(chat_history, add_generation_prompt)
        except jinja2.exceptions.TemplateError:
            eval_logger.warning(
                "Failed to apply chat template. removing the system role in chat history."
            )
            return self._render(
                [m for m in chat_history if m["role"] != "system"], add_generation_prompt
            )

    def _render(self, chat: list[dict], add_generation_prompt: bool) -> str:
        if add_generation_prompt:
            return self.tokenizer.apply_chat_template(
                chat, add_generation_prompt=True, tokenize=False
            )
        tag = "CONTINUE_FINAL_MESSAGE_TAG "
        final = chat[-1]["content"]
        tagged = [*chat[:-1], {**chat[-1], "content": final + tag}]
        text = self.tokenizer.apply_chat_template(
            tagged, add_generation_prompt=False, tokenize=False
        )
        if final.strip() not in text or tag.strip() not in text:
            raise ValueError(
                "continue_final_message: the final message does not appear in the chat after "
                "applying the chat template."
            )
        at = text.rindex(tag.strip())
        return text[:at] if text[at : at + len(tag)] == tag else text[:at].rstrip()

    # -- batch sizes ---------------------------------------------------------------------------

    def _rows(self, kind: str, length: int) -> int:
        """Rows per pass: `batch_size`, or for `"auto"` the most that fit a pass of
        `length` tokens (measured once per kind of request and length bucket)."""
        if self.batch_size != "auto":
            return self.batch_size
        width = bucket(length, self.max_length)
        if (kind, width) not in self.batch_sizes:
            eval_logger.info(
                f"Passed argument batch_size = auto. Detecting largest batch size for {kind}"
            )
            rows = rows_that_fit(self.model, width, limit=self.max_batch_size)
            eval_logger.info(f"Determined largest batch size: {rows}")
            self.batch_sizes[(kind, width)] = rows
        return self.batch_sizes[(kind, width)]


def _cut(text: str, until: list[str]) -> str:
    """`text` before the first of the `until` strings, as lm-eval's `hf` model cuts it
    (`postprocess_generated_text`: split at each non-empty string in turn)."""
    for term in until:
        if term:
            text = text.split(term)[0]
    return text


def _check_batch_size(batch_size):
    if isinstance(batch_size, str):
        if batch_size == "auto" or batch_size.startswith("auto:"):
            return "auto"
        if batch_size.isdigit():
            batch_size = int(batch_size)
        else:
            raise ValueError(f"batch_size must be a positive int or 'auto', got {batch_size!r}.")
    return check_int(batch_size, "batch_size", minimum=1)


_PLATFORMS = {"cpu": "cpu", "cuda": "gpu", "gpu": "gpu", "rocm": "gpu", "tpu": "tpu"}


def _pick_device(device):
    """The JAX device of lm-eval's `device` string, or `None` for JAX's default."""
    if device is None:
        return None
    name, _, index = str(device).lower().partition(":")
    if name not in _PLATFORMS or (index and not index.isdigit()):
        raise ValueError(f"device={device!r}: pass 'cpu', 'cuda', 'cuda:N', 'gpu', 'tpu' or None.")
    try:
        devices = jax.devices(_PLATFORMS[name])
    except RuntimeError:
        eval_logger.warning(f"device={device!r} is not available to JAX; using {jax.devices()[0]}.")
        return None
    position = int(index or 0)
    if position >= len(devices):
        raise ValueError(f"device={device!r}, but JAX sees {len(devices)} {name} device(s).")
    return devices[position]
