"""`eqrope.eval.LM`: eqrope as a model of EleutherAI's lm-evaluation-harness, named "eqrope".

lm-eval asks a model three things (`lm_eval.api.model.LM`): the log-likelihood of a
continuation after a context, the log-likelihood of a whole text (in rolling windows), and
text generated until a stop string. This class answers them with `eqrope.score` and
`eqrope.generate` (the request adapters are in `_lm_requests.py`), and tokenizes as lm-eval's
`hf` model does (`TemplateLM`), so that the same checkpoint gives the same requests and the
same answers. Here: construction, what lm-eval reads, tokens, chat templates, batch sizes.

lm-eval (from its entry-point plugins, PR #4013) finds this class as `eqrope.eval._lm:LM`,
the `lm_eval.models` entry point of pyproject.toml: it must stay defined in this module.

This module imports lm-eval; `eqrope.eval` imports it only when `LM` is asked for.
"""

import logging
import os

import jax
import jinja2
import numpy as np
from lm_eval.api.model import TemplateLM

# The built-in models are registered (lazily) before ours: lm-eval's `get_model` imports
# them only while its registry is empty.
import lm_eval.models  # noqa: F401
from lm_eval.api.registry import register_model
from lm_eval.utils import simple_parse_args_string

from .._checks import check_bool, check_int
from .._custom_types import IntLike
from ..model import count_params
from ..sharding._rules import ShardingRules
from ..text import Tokenizer
from ..weights import from_hf
from . import _lm_requests
from ._arguments import row_multiple
from ._buckets import bucket, rows_that_fit
from ._windows import adapted_rows


eval_logger = logging.getLogger(__name__)


@register_model("eqrope")
class LM(TemplateLM):
    """An eqrope model and tokenizer as an lm-eval model (`--model eqrope`).

    **Arguments** (as `--model_args key=value,...` on the command line):

    - `pretrained`: a Hugging Face checkpoint directory (read with [`eqrope.from_hf`][]
      and [`eqrope.Tokenizer.from_pretrained`][]), or a model in memory, such as a
      [`eqrope.RotaryDecoder`][] being trained (then pass `tokenizer`); not one whose
      adapters are chosen per row ([`eqrope.select_adapters`][]), since lm-eval's requests
      are not the rows of one batch.
    - `tokenizer`: a directory, an [`eqrope.Tokenizer`][], or `None` for `pretrained`'s.
    - `dtype`: the model's dtype when read (`"float32"`, `"bfloat16"`, ...); `None` or
      `"auto"` keeps the checkpoint's.
    - `batch_size`: rows per compiled pass (an int), or `"auto"`: the most rows (a power of
      two, at most `max_batch_size`) whose scoring pass at the requests' length fits the
      memory budget, from XLA's memory analysis of the compiled pass (see
      `eqrope.eval._buckets.rows_that_fit`). `"auto:N"` is read as `"auto"`.
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
        batch_size: IntLike | str = 1,
        max_batch_size: IntLike | None = 64,
        max_length: IntLike | None = None,
        max_gen_toks: IntLike = 256,
        device: str | None = None,
        seed: IntLike = 1234,
        prefix_token_id: IntLike | None = None,
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
        if adapted_rows(model) is not None:
            raise ValueError(
                "pretrained is a model whose adapters are chosen per row "
                "(eqrope.select_adapters), but lm-eval's requests are not rows of one batch; "
                "pass one adapter, eqrope.take_adapter(many, i), and evaluate each in turn."
            )
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
        self.custom_prefix_token_id = check_int(
            prefix_token_id, "prefix_token_id", minimum=0, none=True
        )
        if self.custom_prefix_token_id is not None and self.custom_prefix_token_id >= model.vocab_size:
            raise ValueError(
                f"prefix_token_id={self.custom_prefix_token_id} is outside the model's vocabulary "
                f"[0, {model.vocab_size}); pass a token id of its tokenizer, or None (BOS)."
            )
        self.add_bos_token = None if add_bos_token is None else check_bool(
            add_bos_token, "add_bos_token"
        )
        self.mesh, self.rules = mesh, rules
        self._multiple = row_multiple(mesh, rules)
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

    # -- lm-eval's requests (`_lm_requests.py`) ------------------------------------------------

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
        """Score `(request, context_ids, continuation_ids)` triples; requests with the same
        (truncated) context share one prefill."""
        return _lm_requests.loglikelihood_tokens(self, requests, disable_tqdm, override_bs)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The log-likelihood of each whole text after the prefix token, in the disjoint
        rolling windows of lm-eval's `hf` model."""
        return _lm_requests.loglikelihood_rolling(self, requests, disable_tqdm)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, with `do_sample=True`) text after each context, cut at the
        first `until` string."""
        return _lm_requests.generate_until(self, requests, disable_tqdm)

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
