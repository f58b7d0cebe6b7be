"""A completions or chat request body, checked, as a `Job`: prompts as token ids and the
settings the engine takes.

The fields are OpenAI's (`/v1/completions`, `/v1/chat/completions`) with vLLM's
extensions (`top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos`,
`stop_token_ids`); a field outside that list is refused by name, as OpenAI refuses it, and
one whose value eqrope does not implement (`logit_bias`, `suffix`, `tools`, ...) is refused
unless it changes nothing. The defaults are OpenAI's, then the sampling fields that the
checkpoint's `generation_config.json` sets (vLLM's `--generation-config auto`).
"""

import dataclasses

import jinja2

from . import _fields as f
from ._errors import bad_field
from ._structured import FIELDS as STRUCTURED, requested_spec


_SAMPLING = {
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "seed", "stop", "stop_token_ids", "min_tokens", "ignore_eos", "n",
    "stream", "stream_options", "user", "logit_bias", "model",
}  # fmt: skip
COMPLETION_FIELDS = _SAMPLING | set(STRUCTURED) | {"prompt", "max_tokens", "logprobs", "echo", "best_of", "suffix", "add_special_tokens"}
CHAT_FIELDS = _SAMPLING | set(STRUCTURED) | {
    "messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs",
    "tools", "tool_choice", "parallel_tool_calls", "add_generation_prompt",
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one request may ask of this server."""

    max_len: int  # positions of a sample: prompt plus new tokens
    vocab: int  # the model's vocabulary
    max_n: int  # samples per prompt (the engine's slots)
    max_logprobs: int = 20  # vLLM's default
    max_stop_token_ids: int = 8  # with the EOS ids: the engine's `max_eos_ids`


@dataclasses.dataclass(frozen=True)
class Job:
    """A checked request: each prompt's ids and most new tokens, and the shared settings
    (`settings` are `GenerationConfig` fields; `logprobs` is how many top tokens to give
    at each position, `None` for none)."""

    chat: bool
    model: str
    prompts: tuple[tuple[int, ...], ...]
    texts: tuple[str | None, ...]  # each prompt as the client sent it, when it was a string
    max_tokens: tuple[int, ...]
    n: int
    settings: dict
    stop: tuple[str, ...]
    seed: int | None
    logprobs: int | None
    echo: bool
    stream: bool
    include_usage: bool
    structured: tuple | None = None  # (spec, the field that asked for it): `_structured.py`


def completion_job(body, tokenizer, limits: Limits, defaults: dict) -> Job:
    body = _object(body)
    f.refuse_unknown(body, COMPLETION_FIELDS)
    f.only(body, "best_of", (1,), "best_of must be 1 (use n for several samples).")
    f.only(body, "suffix", ("",), "eqrope does not insert text (no suffix).")
    special = f.boolean(body, "add_special_tokens", True)
    prompt = f.get(body, "prompt")
    prompts = _prompts(prompt, tokenizer, limits.vocab, special)
    texts = tuple(p if isinstance(p, str) else None for p in ([prompt] if isinstance(prompt, str) else prompt))
    logprobs = f.integer(body, "logprobs", None, low=0, high=limits.max_logprobs)
    return _job(body, False, prompts, texts, "max_tokens", logprobs, f.boolean(body, "echo"), limits, defaults, tokenizer)


def chat_job(body, tokenizer, limits: Limits, defaults: dict) -> Job:
    body = _object(body)
    f.refuse_unknown(body, CHAT_FIELDS)
    f.only(body, "tools", ([],), "eqrope's server does not call tools.")
    f.only(body, "tool_choice", ("none",), "eqrope's server does not call tools.")
    f.only(body, "parallel_tool_calls", (False, True), "it takes true or false.")
    prompt = chat_prompt(f.get(body, "messages"), tokenizer, f.boolean(body, "add_generation_prompt", True))
    top = f.integer(body, "top_logprobs", None, low=0, high=limits.max_logprobs)
    if top is not None and not f.boolean(body, "logprobs"):
        raise bad_field("top_logprobs", "top_logprobs needs logprobs: true.")
    logprobs = (top or 0) if f.boolean(body, "logprobs") else None
    name = "max_completion_tokens" if f.get(body, "max_completion_tokens") is not None else "max_tokens"
    return _job(body, True, [prompt], (None,), name, logprobs, False, limits, defaults, tokenizer)


def _job(body, chat, prompts, texts, max_name, logprobs, echo, limits, defaults, tokenizer) -> Job:
    n = f.integer(body, "n", 1, low=1, high=limits.max_n)
    requested = f.integer(body, max_name, None, low=1 if chat else 0)
    max_tokens = []
    for i, prompt in enumerate(prompts):
        room = limits.max_len - len(prompt)
        if room < (1 if requested is None else requested) or (room < 1 and not echo):
            where = "the messages" if chat else (f"prompt {i}" if len(prompts) > 1 else "the prompt")
            raise bad_field(
                "messages" if chat else "prompt",
                f"This model's maximum context length is {limits.max_len} tokens. However, you "
                f"requested {len(prompt) + (requested or 1)} tokens ({len(prompt)} in {where}, "
                f"{requested or 1} in the completion). Please reduce the length of the "
                f"{'messages' if chat else 'prompt'} or {max_name}.",
            )
        default = room if defaults.get("max_new") is None else min(room, defaults["max_new"])
        max_tokens.append(default if requested is None else requested)
    options = f.get(body, "stream_options", {})
    stream = f.boolean(body, "stream")
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise bad_field("stream_options", "stream_options must be an object like {\"include_usage\": true}.")
    if options and not stream:
        raise bad_field("stream_options", "stream_options is only allowed with stream: true.")
    return Job(
        chat=chat, model=f.string(body, "model", ""), prompts=tuple(tuple(p) for p in prompts),
        texts=texts if len(texts) == len(prompts) else (None,) * len(prompts),
        max_tokens=tuple(max_tokens), n=n, settings=_settings(body, defaults, tokenizer, limits, min(max_tokens)),
        stop=f.strings(body, "stop"), seed=f.integer(body, "seed", None, low=-(2**63), high=2**63 - 1),
        logprobs=logprobs, echo=echo, stream=stream, include_usage=f.boolean(options, "include_usage"),
        structured=requested_spec(body),
    )  # fmt: skip


def _settings(body, defaults, tokenizer, limits, max_tokens) -> dict:
    """`GenerationConfig` fields: sampling, penalties, the EOS ids and `min_new`."""
    f.only(body, "logit_bias", ({},), "eqrope does not bias logits; use bad words or stop_token_ids.")
    top_p = f.number(body, "top_p", defaults.get("top_p", 1.0), low=0.0, high=1.0, low_open=True)
    top_k = f.integer(body, "top_k", defaults.get("top_k", -1), low=-1, high=limits.vocab)
    min_p = f.number(body, "min_p", defaults.get("min_p", 0.0), low=0.0, high=1.0)
    min_tokens = f.integer(body, "min_tokens", 0, low=0, high=max_tokens)
    stop_ids = tuple(dict.fromkeys(f.token_ids(f.get(body, "stop_token_ids", []), "stop_token_ids", limits.vocab)))
    eos = stop_ids + (() if f.boolean(body, "ignore_eos") else tuple(tokenizer.eos_ids))
    eos = tuple(dict.fromkeys(eos))
    if len(eos) > limits.max_stop_token_ids:
        raise bad_field(
            "stop_token_ids",
            f"stop_token_ids with the tokenizer's EOS ids make {len(eos)} ids; this server takes "
            f"at most {limits.max_stop_token_ids}.",
        )
    return dict(
        temperature=f.number(body, "temperature", defaults.get("temperature", 1.0), low=0.0),
        top_p=None if top_p == 1.0 else top_p,
        top_k=None if top_k in (-1, 0) else top_k,
        min_p=None if min_p == 0.0 else min_p,
        repetition_penalty=f.number(
            body, "repetition_penalty", defaults.get("repetition_penalty", 1.0), low=0.0, low_open=True
        ),
        presence_penalty=f.number(body, "presence_penalty", 0.0, low=-2.0, high=2.0),
        frequency_penalty=f.number(body, "frequency_penalty", 0.0, low=-2.0, high=2.0),
        eos_id=eos or None,
        min_new=min_tokens,
    )


def _object(body) -> dict:
    if not isinstance(body, dict):
        raise bad_field(None, f"The request body must be a JSON object, got a {type(body).__name__}.")
    return body


def _prompts(prompt, tokenizer, vocab: int, special: bool) -> list[list[int]]:
    """OpenAI's four prompt forms: a string, a list of strings, a list of token ids, or a
    list of such lists."""
    shape = "a string, a list of strings, a list of token ids, or a list of lists of token ids"
    if prompt is None:
        raise bad_field("prompt", f"prompt is required: {shape}.")
    if isinstance(prompt, str):
        prompt = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise bad_field("prompt", f"prompt must be {shape}, got {f._show(prompt)}.")
    out = []
    for i, p in enumerate(prompt):
        name = "prompt" if len(prompt) == 1 else f"prompt[{i}]"
        ids = tokenizer.encode(p, add_special_tokens=special) if isinstance(p, str) else f.token_ids(p, name, vocab)
        if not ids:
            raise bad_field("prompt", f"{name} is empty (no tokens); send at least one token.")
        if max(ids) >= vocab:
            raise bad_field("prompt", f"{name} encodes to ids past the model's vocabulary of {vocab}.")
        out.append(ids)
    return out


def chat_prompt(messages, tokenizer, add_generation_prompt: bool) -> list[int]:
    if tokenizer.chat_template is None:
        raise bad_field("messages", "This model's tokenizer has no chat template; use /v1/completions.")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise bad_field("messages", 'messages must be a non-empty list of {"role": ..., "content": ...} objects.')
    chat = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise bad_field(f"messages[{i}].content", "content parts must be {\"type\": \"text\", \"text\": ...}.")
            content = "".join(p["text"] for p in content)
        if not isinstance(message.get("role"), str) or not isinstance(content, (str, type(None))):
            raise bad_field(f"messages[{i}]", f"messages[{i}] needs a string role and a string content.")
        chat.append({**message, "content": content})
    try:
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=add_generation_prompt)
    except (TypeError, ValueError, jinja2.TemplateError) as e:
        raise bad_field("messages", f"The chat template refused the messages: {e}") from None
    if not ids:
        raise bad_field("messages", "The messages render to no tokens.")
    return ids
