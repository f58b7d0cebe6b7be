"""`eqrope.generate_text`: text in, text out, around `eqrope.generate`."""

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, overload

import numpy as np

from .._checks import check_bool
from .._custom_types import IntLike
from ..generation._automaton import Automaton
from ..generation._generate import generate
from ..generation._generation_config import FROM_CONFIG, GenerationConfig, _FromConfig
from ..generation._hf_generation_config import refuse_hf_keywords
from ..generation._stop_strings import StopStrings
from ..generation._stream import TextStream, print_piece
from ._details import TextGeneration, text_generation
from ._tokenizer import Tokenizer, _a


# What a call returns: texts, or with `return_details=True` the same shape of details.
_Result = str | list[str] | list[list[str]] | TextGeneration | list[TextGeneration] | list[list[TextGeneration]]

# Arguments of `generate` that `generate_text` sets itself.
_OWN = ("eos_id", "prompt_lengths", "return_logprobs", "on_token")


# The types an editor sees: a text per prompt, a list of texts per prompt with num_samples.
@overload
def generate_text(
    model, tokenizer: Tokenizer, prompt: str, max_new: IntLike | _FromConfig = ..., *,
    stream: bool | Callable[[int, str], object] = ..., num_samples: None = ...,
    return_details: Literal[False] = ..., **settings: Any,
) -> str: ...
@overload
def generate_text(
    model, tokenizer: Tokenizer, prompt: str, max_new: IntLike | _FromConfig = ..., *,
    stream: bool | Callable[[int, str], object] = ..., num_samples: int,
    return_details: Literal[False] = ..., **settings: Any,
) -> list[str]: ...
@overload
def generate_text(
    model, tokenizer: Tokenizer, prompt: list[str] | tuple[str, ...], max_new: IntLike | _FromConfig = ...,
    *, stream: bool | Callable[[int, str], object] = ..., num_samples: None = ...,
    return_details: Literal[False] = ..., **settings: Any,
) -> list[str]: ...
@overload
def generate_text(
    model, tokenizer: Tokenizer, prompt: list[str] | tuple[str, ...], max_new: IntLike | _FromConfig = ...,
    *, stream: bool | Callable[[int, str], object] = ..., num_samples: int,
    return_details: Literal[False] = ..., **settings: Any,
) -> list[list[str]]: ...
@overload
def generate_text(
    model, tokenizer: Tokenizer, prompt: str | Sequence[str], max_new: IntLike | _FromConfig = ...,
    *, stream: bool | Callable[[int, str], object] = ..., return_details: bool = ..., **settings: Any,
) -> _Result: ...


def generate_text(
    model,
    tokenizer,  # an eqrope.Tokenizer, checked by `_check_tokenizer` with a message that says the fix
    prompt,  # a string or a list of them, checked by `_prompts`
    max_new: IntLike | _FromConfig = FROM_CONFIG,
    *,
    stream: bool | Callable[[int, str], object] = False,
    return_details=False,  # a bool, checked with a message that names it
    **settings,
) -> _Result:
    """Generate up to `max_new` tokens after a text prompt, and return the new text.

    **Arguments:**

    - `model`: a model for [`eqrope.generate`][] whose vocabulary covers the tokenizer's.
    - `tokenizer`: an [`eqrope.Tokenizer`][]. Prompts are encoded with its special-token
      rules (a BOS token, say).
    - `prompt`: a string, or a list of strings, which run as one ragged batch
      (`Tokenizer.encode_batch` and `prompt_lengths`).
    - `max_new`: the most tokens to add to each prompt (or the `config`'s).
    - `stream`: `True` writes the new text of a single string prompt to standard output
      as it is generated; a function `stream(row, piece)` receives each row's text in
      pieces instead (`row` as `generate`'s `on_token` numbers them). The pieces are
      decoded incrementally: a multi-byte character split over several tokens comes
      out whole, once its last byte is there. A row's pieces join into the text
      returned for it.
    - `settings`: any other keyword of `eqrope.generate` (`temperature`, `top_k`, `top_p`,
      `key`, `max_len`, `config`, `num_samples`, ...), except `eos_id`, `prompt_lengths`,
      `return_logprobs` and `on_token`, which `generate_text` sets. `stop` may hold
      strings (or be one) beside token-id sequences: a row ends after the token that
      completes a string in its text, however the model tokenized it (`"mat"` stops
      `" m" "at"` and `" mat."` alike), as transformers' `stop_strings` do; the text
      returned keeps that whole token (see [`eqrope.StopStrings`][]). A string prompt
      samples as `generate` does with a 1-D prompt and the same `key`; a list as a batch.
      `constraint` may hold, beside compiled automata, anything with a
      `compile(tokenizer, vocab=...)` method (`eqrope.Regex`, `eqrope.Choice`,
      `eqrope.JsonSchema`): it is compiled with this tokenizer and the model's
      `vocab_size` (one entry per prompt of a list, or one for every prompt).

    - `return_details`: return a [`eqrope.TextGeneration`][] in place of each text: the
      text with its new token ids, their count and why the row ended (`"eos"`, `"stop"`
      or `"length"`).

    **Returns:** the new text of each prompt (a string for a string, a list for a list;
    with `num_samples`, a list of that many texts in place of each text), decoded with
    `skip_special_tokens=True` and ended before the first EOS id.

    Each row stops generating at the first of the tokenizer's EOS ids (Llama-3 instruct
    lists three): they all go to `generate` as `eos_id`. A `config` with an `eos_id` uses
    its ids instead.

    Refused (`ValueError`): a prompt that encodes to no tokens (an empty string, with a
    tokenizer that adds no BOS token), named with its index in a list; a tokenizer with
    more token ids than the model's `vocab_size`; and whatever `generate` refuses.
    Refused (`TypeError`), with the fix: a tokenizer that is not an `eqrope.Tokenizer`
    (a `tokenizers.Tokenizer` goes in `eqrope.Tokenizer(...)`), chat messages (render
    them with `tokenizer.apply_chat_template` first), a prompt that is not text, and
    transformers' keywords (`max_new_tokens`, `do_sample`, ...). An exception raised by
    `stream`, of any kind (`KeyboardInterrupt` included), reaches the caller as it is, and
    no more pieces are sent.
    """
    taken = sorted(set(_OWN) & set(settings))
    if taken:
        raise TypeError(f"generate_text sets {taken} itself; pass the tokenizer's eos_ids instead.")
    refuse_hf_keywords(settings, "generate_text")
    check_bool(return_details, "generate_text: return_details")
    _check_tokenizer(tokenizer, model)
    prompt = _prompts(prompt)
    one = isinstance(prompt, str)
    if one:
        ids, lengths = np.asarray(tokenizer.encode(prompt), np.int32), None
        if ids.size == 0:
            raise ValueError(_EMPTY.format(name="prompt", text=prompt))
    else:
        prompt = list(prompt)
        if not prompt:
            return []
        ids, lengths = tokenizer.encode_batch(prompt)
        empty = np.flatnonzero(lengths == 0)
        if empty.size:
            i = int(empty[0])
            raise ValueError(_EMPTY.format(name=f"prompt[{i}]", text=prompt[i]))
    config = settings.get("config") or GenerationConfig()
    eos_ids = _eos_ids(config.eos_id, tokenizer)
    stop = settings.get("stop", config.stop)
    if isinstance(stop, str):
        stop = [stop]
    if isinstance(stop, (list, tuple)) and any(isinstance(s, str) for s in stop):
        strings = [s for s in stop if isinstance(s, str)]
        settings["stop"] = [s for s in stop if not isinstance(s, str)] + [StopStrings(tokenizer, strings)]
    if settings.get("constraint") is not None:
        settings["constraint"] = _compiled(settings["constraint"], tokenizer, getattr(model, "vocab_size", None))
    text_stream = _text_stream(stream, one, settings, config, tokenizer, eos_ids)
    result = generate(
        model, ids, max_new, eos_id=list(eos_ids) or None, prompt_lengths=lengths,
        return_logprobs=True, on_token=text_stream and text_stream.on_token, **settings,
    )  # fmt: skip
    samples = settings.get("num_samples", config.num_samples)
    tokens = np.asarray(result.tokens)
    tokens = tokens.reshape(-1, tokens.shape[-1])
    starts = np.repeat([len(ids)] if lengths is None else lengths, samples or 1)
    ends = np.asarray(result.lengths).reshape(-1)
    texts = [
        tokenizer.decode(_until(row[start:end], eos_ids), skip_special_tokens=True)
        for row, start, end in zip(tokens, starts, ends)
    ]
    if text_stream is not None:
        for row, text in enumerate(texts):
            text_stream.finish(row, text)
    if return_details:
        stop, min_new = settings.get("stop", config.stop), settings.get("min_new", config.min_new)
        texts = [
            text_generation(text, row[:start], row[start:end], eos_ids, stop, int(min_new))
            for text, row, start, end in zip(texts, tokens, starts, ends)
        ]
    if samples is not None:
        texts = [texts[i : i + samples] for i in range(0, len(texts), samples)]
    return texts[0] if one else texts


_EMPTY = (
    "generate_text: {name} = {text!r} encodes to no tokens, and generation needs at least "
    "one token to follow. Give it some text, or use a tokenizer that adds a BOS token."
)


def _check_tokenizer(tokenizer, model) -> None:
    """A `TypeError` for what is not an `eqrope.Tokenizer` (a raw `tokenizers.Tokenizer`,
    a transformers tokenizer), a `ValueError` for one larger than the model's vocabulary."""
    if not isinstance(tokenizer, Tokenizer):
        raise TypeError(
            f"generate_text: tokenizer is a {type(tokenizer).__module__}.{type(tokenizer).__name__}, "
            "not an eqrope.Tokenizer. Read a checkpoint's with "
            "eqrope.Tokenizer.from_pretrained(path), or wrap a tokenizers.Tokenizer as "
            "eqrope.Tokenizer(tokenizers_obj, eos_ids=(...))."
        )
    vocab = getattr(model, "vocab_size", None)
    if vocab is not None and tokenizer.vocab_size > vocab:
        raise ValueError(
            f"generate_text: the tokenizer has {tokenizer.vocab_size} token ids but the model's "
            f"vocab_size is {vocab}, so some of its tokens have no embedding. Use the "
            "tokenizer the model was trained with, or a model with at least "
            f"{tokenizer.vocab_size} ids."
        )


def _prompts(prompt) -> str | list:
    """`prompt` as a string or a list, with a `TypeError` for what is not text: chat
    messages (to render first) or token ids (for `generate`)."""
    if isinstance(prompt, str):
        return prompt
    items = [prompt] if isinstance(prompt, dict) or not isinstance(prompt, Iterable) else list(prompt)
    chat = lambda m: isinstance(m, dict) or (isinstance(m, (list, tuple)) and m and isinstance(m[0], dict))
    if any(map(chat, items)):
        raise TypeError(
            "generate_text: prompt holds chat messages ({\"role\": ..., \"content\": ...} dicts); "
            "it takes text. Render them first: text = tokenizer.apply_chat_template(messages, "
            "add_generation_prompt=True, tokenize=False), then generate_text(model, tokenizer, "
            "text, ...)."
        )
    bad = next((i for i, m in enumerate(items) if not isinstance(m, str)), None)
    if bad is not None:  # `None` itself is named: it is neither text nor token ids
        item = items[bad]
        got = _a(item) if item is prompt else f"{_a(prompt)} holding {_a(item)} at prompt[{bad}]"
        hint = "" if item is None else "; for token ids use eqrope.generate"
        raise TypeError(
            f"generate_text: prompt must be a string or a list of strings, got {got}{hint}."
        )
    return items


def _compiled(constraint, tokenizer, vocab):
    """`generate`'s `constraint` from `generate_text`'s: each entry with a `compile` method
    compiled with `tokenizer` over the model's `vocab` ids (each distinct one once)."""
    done: dict[int, object] = {}

    def one(c):
        if c is None or not callable(getattr(c, "compile", None)):
            return c  # an Automaton (a NamedTuple, which has no compile method) or a mistake generate names
        if id(c) not in done:
            done[id(c)] = c.compile(tokenizer, vocab=vocab)
        return done[id(c)]

    if isinstance(constraint, (list, tuple)) and not isinstance(constraint, Automaton):
        return [one(c) for c in constraint]
    return one(constraint)


def _eos_ids(config_eos, tokenizer: Tokenizer) -> tuple[int, ...]:
    if config_eos is None:
        return tuple(tokenizer.eos_ids or ())
    return (config_eos,) if isinstance(config_eos, int) else tuple(config_eos)


def _text_stream(stream, one: bool, settings: dict, config, tokenizer, eos_ids):
    if stream is False or stream is None:
        return None
    if stream is True:
        if not one or settings.get("num_samples", config.num_samples) is not None:
            raise ValueError(
                "stream=True prints the text of one string prompt; for a batch or "
                "num_samples pass stream=function(row, piece)."
            )
        return TextStream(tokenizer, eos_ids, print_piece)
    if not callable(stream):
        raise TypeError(f"stream must be True, False or a function (row, piece), got {stream!r}.")
    return TextStream(tokenizer, eos_ids, stream)


def _until(new: np.ndarray, eos_ids: tuple[int, ...]) -> np.ndarray:
    """`new` up to (not including) its first token in `eos_ids`."""
    hits = np.flatnonzero(np.isin(new, eos_ids))
    return new[: hits[0]] if hits.size else new
