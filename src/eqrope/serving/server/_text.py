"""`TextStream`: one generated sample's text as its tokens arrive, with its stop strings.

Incremental detokenization as vLLM does it (`vllm/transformers_utils/detokenizer_utils.py`,
`detokenize_incrementally`): each new token decodes a short window of ids, from
`prefix_offset` on, and the new text is that window's text less the text of its first
`read_offset - prefix_offset` ids. The window starts in the prompt, so that a
SentencePiece (Metaspace) decoder, which drops the space of the first token it is given,
keeps the space of the first generated token. Stop strings are matched on the text, as
vLLM V1's `check_stop_strings` matches them, and `take` holds back what could still
become a stop string (vLLM V1's `stop_buffer_length`). Pure host code.
"""

from typing import final


from ..._checks import as_int_array, check_bool, check_int
from ...text._tokenizer import Tokenizer


# The non-special prompt tokens the first window starts with (vLLM's
# `INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET`).
CONTEXT = 5
# What a decoder gives for an incomplete UTF-8 sequence: held back until it completes.
REPLACEMENT = "\ufffd"


@final
class TextStream:
    """One generated sample's text, token by token, for the server.

    `push` adds one generated token: its text is decoded incrementally and searched for
    the stop strings. `take` hands out the text not yet handed out that is safe to send.
    Concatenating every `take()`, the last one `take(finished=True)`, gives `text`.

    **Arguments:**

    - `tokenizer`: an [`eqrope.Tokenizer`][].
    - `prompt`: the prompt's token ids (a list or a 1-D integer array). Only its last
      tokens are decoded: up to `CONTEXT` (5) that are not skipped special tokens, and
      the special tokens between them.
    - `stop`: stop strings (OpenAI's `stop`). The text ends before the first one found;
      it is not part of the text. Each must be a non-empty string that does not end in
      U+FFFD (the character that stands for an incomplete byte sequence).
    - `min_tokens`: stop strings are not looked for until this many tokens were pushed,
      and a match that lies wholly in the text of those tokens is never found (as vLLM's
      `min_tokens` delays stop strings).
    - `skip_special_tokens`: leave special tokens (`<s>`, `</s>`, ...) out of the text, as
      vLLM does by default.

    **What the text is:** for a prompt whose decoded text does not end inside a
    character, `text` after `take(finished=True)` is `decode(prompt + generated)` less
    its first `len(decode(prompt))` characters, cut before the stop string that matched;
    and after the `k`-th `push`, before the end, it is that text for the first `k`
    tokens without a final run of U+FFFD (an incomplete character, sent once it
    completes or at the end, as the full decode writes it). Decoders whose text of a
    token depends on tokens after it (the byte-fallback decoder of a run of invalid bytes,
    WordPiece's clean-up of spaces) can differ from the full decode, as they do in vLLM.
    """

    def __init__(self, tokenizer, prompt, stop=(), *, min_tokens=0, skip_special_tokens=True):
        if not isinstance(tokenizer, Tokenizer):
            raise TypeError(
                f"TextStream: tokenizer must be an eqrope.Tokenizer, got {type(tokenizer).__name__}."
            )
        self._tokenizer = tokenizer
        self._skip = check_bool(skip_special_tokens, "skip_special_tokens")
        self._min_tokens = check_int(min_tokens, "min_tokens", minimum=0)
        self._stop = _check_stop(stop)
        # What `take` holds back: the longest stop string but its last character.
        self._hold = max(map(len, self._stop), default=1) - 1
        prompt = as_int_array(prompt, "prompt", ndim=1)
        if prompt.size and int(prompt.min()) < 0:
            raise ValueError(f"TextStream: prompt holds a negative token id ({int(prompt.min())}).")
        # The window: ids from vLLM's `prefix_offset` on; its first `_read` are the ids
        # whose text is already in `text` (vLLM's `read_offset`), or in the prompt.
        self._window = self._context(prompt.tolist())
        self._read = len(self._window)
        self._shown = 0  # characters of the window's text past its first `_read` ids, in `text`
        self._text = ""
        self._taken = 0
        self._tokens = 0
        self._stopped: str | None = None
        self._finished = False

    def __repr__(self) -> str:
        return (
            f"TextStream(tokens={self._tokens}, text={self._text!r}, stopped={self._stopped!r}, "
            f"taken={self._taken})"
        )

    @property
    def text(self) -> str:
        """The whole text so far, cut before a stop string that matched."""
        return self._text

    @property
    def tokens(self) -> int:
        """The tokens pushed (the completion tokens; the last is the one that completed a
        stop string, if one did)."""
        return self._tokens

    @property
    def stopped(self) -> str | None:
        """The stop string that matched, or `None`. When several complete at the same
        token, the one that starts first in the text (the first listed at a tie)."""
        return self._stopped

    def push(self, token) -> bool:
        """Add one generated token.

        **Arguments:**

        - `token`: a token id (a Python or NumPy integer). An id past the tokenizer's
          vocabulary (a model's padded embedding rows) has no text, as in the tokenizer.

        **Returns:** `True` when a stop string is now complete in the text: the sample
        ends at this token, and a later `push` raises a `RuntimeError`, as it does after
        `take(finished=True)`.
        """
        token = check_int(token, "token", minimum=0)
        if self._stopped is not None:
            raise RuntimeError(
                f"TextStream.push: the sample already ended at stop string {self._stopped!r} "
                f"(token {self._tokens}); push no more tokens after push returned True."
            )
        if self._finished:
            raise RuntimeError("TextStream.push: the sample is finished (take(finished=True) was called).")
        self._tokens += 1
        before = len(self._text)
        self._text += self._next_text(token)
        if not self._stop or self._tokens <= self._min_tokens or len(self._text) == before:
            return False
        return self._match(before)

    def take(self, finished=False) -> str:
        """The text not taken yet that is safe to send.

        **Arguments:**

        - `finished`: the sample has ended (no more `push`).

        **Returns:** while not finished (and not stopped), the new text but its last
        `len(longest stop string) - 1` characters, which could still begin a stop
        string; an incomplete character is never in `text` before the end. With
        `finished=True`, or once stopped, everything left: an incomplete character at
        the very end is written as the full decode writes it (U+FFFD), and not searched
        for stop strings.
        """
        if check_bool(finished, "finished") and not self._finished:
            self._finished = True
            if self._stopped is None:
                known = len(self._decode(self._window[: self._read])) + self._shown
                self._text += self._decode(self._window)[known:]
        if self._finished or self._stopped is not None:
            end = len(self._text)
        else:
            end = max(self._taken, len(self._text) - self._hold)
        piece = self._text[self._taken : end]
        self._taken = end
        return piece

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip) if ids else ""

    def _context(self, prompt: list[int]) -> list[int]:
        """The prompt's last `CONTEXT` tokens that decode, with the skipped special
        tokens between them: vLLM takes the last 5 (7 with specials) and may find none
        left, and then a Metaspace decoder would drop the first generated token's space."""
        special = set()
        if self._skip:
            added = self._tokenizer.tokenizer.get_added_tokens_decoder()
            special = {i for i, t in added.items() if t.special}
        start, found = len(prompt), 0
        while start > 0 and found < CONTEXT:
            start -= 1
            found += prompt[start] not in special
        return prompt[start:]

    def _next_text(self, token: int) -> str:
        """Decode the window with `token` added; the text it adds, and move the offsets."""
        self._window.append(token)
        read = len(self._decode(self._window[: self._read]))  # vLLM's `prefix_text`
        text = self._decode(self._window)
        known = read + self._shown
        if text.endswith(REPLACEMENT):
            # An incomplete character: hold it back, but send the complete text before it
            # (vLLM holds the whole token: "x" + half of "é" would delay the "x").
            new = text.rstrip(REPLACEMENT)[known:]
            self._shown += len(new)
            return new
        if len(text) > read:  # the window's text grew, complete: a new read offset
            self._window = self._window[self._read :]
            self._read, self._shown = len(self._window), 0
        return text[known:]

    def _match(self, before: int) -> bool:
        """Find a stop string that ends in the text past `before` (an earlier match would
        have been found at an earlier token); cut the text at the first one."""
        found = []
        for order, stop in enumerate(self._stop):
            at = self._text.find(stop, max(0, before - len(stop) + 1))
            if at >= 0:
                found.append((at, order, stop))
        if not found:
            return False
        at, _, stop = min(found)
        self._text, self._stopped = self._text[:at], stop
        return True


def _check_stop(stop) -> tuple[str, ...]:
    """The stop strings, checked, once each, in order."""
    if isinstance(stop, str):
        raise TypeError(f"TextStream: stop must be a tuple of strings; wrap one string as ({stop!r},).")
    if not isinstance(stop, (tuple, list)):
        raise TypeError(f"TextStream: stop must be a tuple of strings, got {type(stop).__name__}.")
    for i, s in enumerate(stop):
        if not isinstance(s, str):
            raise TypeError(f"TextStream: stop[{i}] must be a string, got {s!r} ({type(s).__name__}).")
        if not s:
            raise ValueError(f"TextStream: stop strings must be non-empty; stop[{i}] is ''.")
        if s.endswith(REPLACEMENT):
            raise ValueError(
                f"TextStream: stop[{i}]={s!r} ends in U+FFFD, which stands for an incomplete "
                "character until the next token arrives; such a stop string cannot be matched "
                "as the text arrives. Leave the final U+FFFD out."
            )
    return tuple(dict.fromkeys(stop))
