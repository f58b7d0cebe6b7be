"""`eqrope.Tokenizer`: a Hugging Face checkpoint's tokenizer and chat template, read with
the `tokenizers` package and rendered with jinja2, without transformers or torch.

The chat template renders as transformers renders it (`transformers/utils/
chat_template_utils.py`): a sandboxed jinja2 environment with `trim_blocks` and
`lstrip_blocks`, the `loopcontrols` extension, a `tojson` filter that keeps non-ASCII text,
the `raise_exception` and `strftime_now` helpers, and the named special tokens
(`bos_token`, `eos_token`, ...) as variables.
"""

import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import NoReturn, final

import jinja2
import jinja2.ext
import jinja2.sandbox
import numpy as np
import tokenizers
from jaxtyping import Int32

from .._checks import check_bool, check_int, check_path, not_local
from .._custom_types import IntLike
from .._json import checked, read_json
from ..generation._hf_generation_config import eos_ids_of
from ._token_bytes import token_bytes


# The named special tokens of tokenizer_config.json that chat templates see as variables
# (transformers' `SPECIAL_TOKENS_ATTRIBUTES`).
_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_WHO = "eqrope.Tokenizer.from_pretrained"


@final
class Tokenizer:
    """A text tokenizer with its special tokens and chat template, on the host.

    Build one with [`eqrope.Tokenizer.from_pretrained`][] from a Hugging Face checkpoint
    directory, or directly from a `tokenizers.Tokenizer`.

    **Arguments:**

    - `tokenizer`: a `tokenizers.Tokenizer`. Its own padding and truncation are switched
      off (`encode_batch` pads).
    - `eos_ids`: the token ids that end a text, most important first.
    - `pad_id`: the padding token's id, or `None`.
    - `chat_template`: a jinja2 chat template, or `None`.
    - `special_tokens`: the named special tokens (`{"bos_token": "<s>", ...}`), which the
      chat template sees as variables.
    - `clean_up_spaces`: remove the spaces that WordPiece-style decoders leave before
      punctuation (`clean_up_tokenization_spaces`; transformers ignores it for BPE models).
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        eos_ids: Sequence[IntLike] = (),
        pad_id: IntLike | None = None,
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
        clean_up_spaces: bool = False,
    ):
        tokenizer.no_padding()
        tokenizer.no_truncation()
        self.tokenizer = tokenizer
        if isinstance(eos_ids, str) or not hasattr(eos_ids, "__iter__"):
            raise TypeError(f"Tokenizer: eos_ids must be a sequence of token ids, like (2,), got {eos_ids!r}.")
        self.eos_ids = tuple(check_int(i, f"Tokenizer: eos_ids[{k}]", minimum=0) for k, i in enumerate(eos_ids))
        self.pad_id = check_int(pad_id, "Tokenizer: pad_id", minimum=0, none=True)
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})
        self.clean_up_spaces = bool(clean_up_spaces)
        self._source: str | None = None  # the folder `from_pretrained` read, for the repr
        self._token_bytes: list[bytes] | None = None  # `token_bytes()`, read at its first call

    def __repr__(self) -> str:
        source = f"{self._source!r}, " if self._source is not None else ""
        template = "yes" if self.chat_template is not None else "none"
        return (
            f"Tokenizer({source}vocab_size={self.vocab_size}, eos_ids={self.eos_ids}, "
            f"pad_id={self.pad_id}, chat_template={template})"
        )

    def __call__(self, *args, **kwargs) -> NoReturn:
        """Not callable, unlike transformers' tokenizers: a `TypeError` that names the
        methods (`encode` for one text, `encode_batch` for several)."""
        raise TypeError(
            "an eqrope.Tokenizer is not callable (unlike transformers' tokenizers): use "
            "tokenizer.encode(text) for one text's token ids, or tokenizer.encode_batch(texts) "
            "for a right-padded (ids, lengths) batch, and tokenizer.decode(ids) back."
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "Tokenizer":
        """Read the tokenizer of a Hugging Face checkpoint directory.

        **Arguments:**

        - `path`: a directory holding `tokenizer.json` (a "fast" tokenizer), and optionally
          `tokenizer_config.json` (the special tokens, an inline `chat_template`),
          `chat_template.jinja` (which wins over the inline template, as in transformers) and
          `generation_config.json` (more EOS ids: Llama-3 instruct lists several). A path
          to the `tokenizer.json` file itself reads its directory.

        **Returns:** a `Tokenizer`. Its `eos_ids` are the `eos_token` of
        tokenizer_config.json, then the `eos_token_id`s of generation_config.json not already
        listed; its `pad_id` is the `pad_token`'s id, or `None`.

        `encode` follows the post-processor of tokenizer.json (which adds a BOS token if the
        checkpoint does); the `add_bos_token`/`add_eos_token` switches of some
        tokenizer_config.json files are not applied.

        Raises `FileNotFoundError` without tokenizer.json (for a path that does not exist,
        such as a hub id, saying that eqrope does not download), and `ValueError`, naming
        the file and the key, for a file that is not valid JSON or tokenizer.json, and for a
        field it reads of the wrong type: a named special token (`eos_token`, `pad_token`, ...)
        that is neither a string nor an AddedToken record (`{"content": "</s>", ...}`), so
        `"eos_token": 1` is refused rather than read as the token "1"; a special token not
        in the vocabulary; a `chat_template` that is neither a string nor a list of
        `{"name": ..., "template": ...}` records; a `clean_up_tokenization_spaces` that is
        not a bool; an `eos_token_id` in generation_config.json that is not a token id or
        a list of them (`"</s>"`, `true`, `-1`).
        """
        given, path = path, check_path(path, f"{_WHO}: path")
        folder = path.parent if path.name == "tokenizer.json" and path.is_file() else path
        file = folder / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"{_WHO}: {file} not found: {not_local(given)}")
        if not file.is_file():
            raise FileNotFoundError(
                f"{_WHO}: {file} not found. Pass a Hugging Face checkpoint directory that holds "
                "tokenizer.json (a 'fast' tokenizer; slow sentencepiece-only tokenizers can be "
                "converted by saving them once with transformers' AutoTokenizer)."
            )
        try:
            tokenizer = tokenizers.Tokenizer.from_file(str(file))
        except Exception as e:  # noqa: BLE001 (the Rust side raises a bare Exception)
            raise ValueError(f"{_WHO}: {file} is not a valid tokenizer.json ({e}).") from None
        config_file = folder / "tokenizer_config.json"
        config = read_json(config_file, _WHO) if config_file.is_file() else {}
        where = f"{_WHO}: {config_file}"
        special = {n: _content(config[n], n, where) for n in _SPECIAL if config.get(n) is not None}

        def token_id(name: str) -> int | None:
            if name not in special:
                return None
            found = tokenizer.token_to_id(special[name])
            if found is None:
                raise ValueError(
                    f"{_WHO}: {config_file} names {name} {special[name]!r}, which is not in the "
                    f"vocabulary of {file}."
                )
            return found

        eos = token_id("eos_token")
        eos_ids = [] if eos is None else [eos]
        generation_file = folder / "generation_config.json"
        if generation_file.is_file():
            extra = read_json(generation_file, _WHO).get("eos_token_id")
            eos_ids += checked(eos_ids_of, extra, "eos_token_id", f"{_WHO}: {generation_file}")
        clean_up = config.get("clean_up_tokenization_spaces")
        clean_up = clean_up is not None and checked(
            check_bool, clean_up, "clean_up_tokenization_spaces", where
        )
        read = cls(
            tokenizer,
            eos_ids=tuple(dict.fromkeys(eos_ids)),  # in order, once each
            pad_id=token_id("pad_token"),
            chat_template=_read_template(folder, config, where),
            special_tokens=special,
            clean_up_spaces=clean_up and type(tokenizer.model).__name__ != "BPE",
        )
        read._source = str(folder)
        return read

    @property
    def vocab_size(self) -> int:
        """The number of token ids, added tokens included."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """The token ids of `text`; `add_special_tokens` applies the checkpoint's
        post-processor (a BOS token, say), as transformers does by default."""
        _check_text(text, "encode: text")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(
        self, texts: Sequence[str], *, add_special_tokens: bool = True
    ) -> tuple[Int32[np.ndarray, "batch seq"], Int32[np.ndarray, " batch"]]:
        """Encode several texts into one right-padded array.

        **Returns:** `(ids, lengths)`: `ids` of shape `(batch, seq)`, `seq` the longest
        text's length, padded on the right with `pad_id` (0 without one), and each text's
        length, ready for `eqrope.generate(model, ids, ..., prompt_lengths=lengths)`.
        """
        if isinstance(texts, str) or not isinstance(texts, Iterable):
            raise TypeError(
                f"encode_batch takes a list of strings, got {_a(texts)}; use encode for one string."
            )
        texts = list(texts)
        for i, text in enumerate(texts):
            _check_text(text, f"encode_batch: texts[{i}]")
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)
        rows = [e.ids for e in encodings]
        lengths = np.asarray([len(r) for r in rows], np.int32)
        ids = np.full((len(rows), int(lengths.max(initial=0))), self.pad_id or 0, np.int32)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = row
        return ids, lengths

    def decode(self, ids, *, skip_special_tokens: bool = False) -> str:
        """The text of a sequence of token ids (a list, or a 1-D NumPy or JAX array)."""
        ids = np.asarray(ids)
        if ids.ndim > 1:
            raise ValueError(f"decode takes one sequence of token ids, got shape {ids.shape}.")
        text = self.tokenizer.decode(ids.reshape(-1).tolist(), skip_special_tokens=skip_special_tokens)
        return _clean_up(text) if self.clean_up_spaces else text

    def token_bytes(self) -> list[bytes]:
        """The bytes each token id spells (`b""` for special tokens), as stop strings
        ([`eqrope.StopStrings`][]) match them. Read once, then kept."""
        if self._token_bytes is None:
            self._token_bytes = token_bytes(self.tokenizer)
        return self._token_bytes

    def apply_chat_template(
        self, messages, *, add_generation_prompt: bool = False, tokenize: bool = True, **variables
    ) -> list[int] | str | list[list[int]] | list[str]:
        """Render a conversation, or a batch of them, with the checkpoint's chat template.

        **Arguments:**

        - `messages`: one conversation, a list of `{"role": ..., "content": ...}` dicts (keys
          whose value is `None` are dropped, as transformers does); or a batch, a list of
          such lists, rendered one by one as transformers does. Anything else (a single
          dict, a message that is not a dict, an empty conversation) raises a `TypeError`
          or `ValueError` that shows the expected shape.
        - `add_generation_prompt`: end with the template's opening of an assistant turn.
        - `tokenize`: return token ids (encoded without adding special tokens: the template
          writes them); `False` returns the rendered string.
        - `variables`: more template variables (`tools=...`, `enable_thinking=...`); they
          win over the special tokens of the same name.

        **Returns:** for one conversation, its token ids (or its string); for a batch, a
        list of them, one per conversation.
        """
        if self.chat_template is None:
            raise ValueError(
                "apply_chat_template: this tokenizer has no chat template (no chat_template in "
                "tokenizer_config.json and no chat_template.jinja beside it). Pass "
                "chat_template=... to Tokenizer, or use a chat checkpoint's tokenizer."
            )
        batched = _is_batch(messages)
        chats = [_chat(c, f"messages[{i}]") for i, c in enumerate(messages)] if batched else [
            _chat(messages, "messages")
        ]
        variables = {"tools": None, "documents": None, **self.special_tokens, **variables}
        template = _compile(self.chat_template)
        out = []
        for chat in chats:
            text = template.render(messages=chat, add_generation_prompt=add_generation_prompt, **variables)
            out.append(self.encode(text, add_special_tokens=False) if tokenize else text)
        return out if batched else out[0]


_SHAPE = (
    'a list of {"role": ..., "content": ...} dicts (one conversation), or a list of such '
    "lists (a batch)"
)


def _is_batch(messages) -> bool:
    """Whether `messages` is a batch of conversations (transformers' test: the first entry
    is itself a list or tuple)."""
    if isinstance(messages, (str, bytes, dict)) or not isinstance(messages, (list, tuple)):
        raise TypeError(
            f"apply_chat_template: messages must be {_SHAPE}; got a {type(messages).__name__}"
            + (" (wrap one message in a list: [message])." if isinstance(messages, dict) else ".")
        )
    return bool(messages) and isinstance(messages[0], (list, tuple))


def _chat(conversation, name: str) -> list[dict]:
    """One conversation's messages, checked, without their `None` values."""
    if not isinstance(conversation, (list, tuple)):
        raise TypeError(
            f"apply_chat_template: {name} is a {type(conversation).__name__}; messages must "
            f"be {_SHAPE}, not a mix."
        )
    if not conversation:
        raise ValueError(f"apply_chat_template: {name} is empty; a conversation needs at least one message.")
    for i, m in enumerate(conversation):
        if not isinstance(m, dict):
            raise TypeError(
                f"apply_chat_template: {name}[{i}] is a {type(m).__name__} ({m!r}), not a "
                f"message; messages must be {_SHAPE}."
            )
    return [{k: v for k, v in m.items() if v is not None} for m in conversation]


def _content(token, name: str, where: str) -> str:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken
    record (`{"content": "</s>", "lstrip": false, ...}`); anything else is refused by name
    (`"eos_token": 1` is not the token "1")."""
    content = token.get("content") if isinstance(token, dict) else token
    if not isinstance(content, str):
        raise ValueError(
            f"{where} has {name}={token!r}; a special token is a string (\"</s>\") or an "
            "AddedToken record ({\"content\": \"</s>\", ...}) whose content is a string."
        )
    return content


def _a(x) -> str:
    """`None`, or `x`'s type with its article: "an int", "a list"."""
    name = type(x).__name__
    return "None" if x is None else f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _check_text(text, name: str) -> None:
    if not isinstance(text, str):
        raise TypeError(f"{name} must be a string, got {_a(text)}.")


def _read_template(folder: Path, config: dict, where: str) -> str | None:
    """chat_template.jinja, else the inline `chat_template` (a string, or a list of named
    templates `{"name": ..., "template": ...}`, of which the one named "default")."""
    file = folder / "chat_template.jinja"
    if file.is_file():
        return file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    entries = template if isinstance(template, list) else [None]
    for i, t in enumerate(entries):
        if not (isinstance(t, dict) and all(isinstance(t.get(k), str) for k in ("name", "template"))):
            at = f"chat_template[{i}]={t!r}" if isinstance(template, list) else f"chat_template={template!r}"
            raise ValueError(
                f"{where} has {at}; chat_template is a string, or a list of named templates "
                "like [{\"name\": \"default\", \"template\": \"...\"}], each with a string "
                "name and template."
            )
    return {t["name"]: t["template"] for t in template}.get("default")


def _clean_up(text: str) -> str:
    """transformers' `clean_up_tokenization`."""
    for before, after in (
        (" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
        (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"),
    ):  # fmt: skip
        text = text.replace(before, after)
    return text


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`, which marks assistant text for
    transformers' assistant masks: here it renders its body unchanged."""

    tags = frozenset({"generation"})

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
