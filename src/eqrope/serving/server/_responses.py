"""A run's answer as OpenAI's JSON: whole (`text_completion`, `chat.completion`) or as
server-sent chunks (`…chunk`), with `usage` and the log-probability objects of each API.

- Completions' `logprobs`: `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`,
  one entry per token; with `echo`, the prompt's tokens first (the first has `None`,
  nothing comes before it). `top_logprobs[i]` maps the top `logprobs` tokens' strings to
  their log-probabilities, plus the token itself (vLLM's `logprobs + 1` entries).
- Chat's `logprobs`: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`.
"""

import time
import uuid

import numpy as np

from ._logprobs import TokenLogprobs
from ._run import Choice, JobRun


class Answer:
    """The JSON of one run: ids and timestamps fixed at the start."""

    def __init__(self, run: JobRun, model_name: str):
        self.run, self.model = run, model_name
        self.chat = run.job.chat
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.tokenizer = run.server.tokenizer

    def head(self, chunk: bool) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def usage(self) -> dict:
        prompt = sum(len(p) for p in self.run.job.prompts)
        completion = sum(len(c.tokens) for c in self.run.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def prompt_text(self, choice: Choice) -> str:
        job = self.run.job
        text = job.texts[choice.prompt]
        return text if text is not None else self.tokenizer.decode(job.prompts[choice.prompt], skip_special_tokens=True)

    # -- whole -------------------------------------------------------------------------

    async def whole(self) -> dict:
        choices = []
        for c in self.run.choices:
            text = c.text.take(finished=True)
            if self.run.job.echo:
                text = self.prompt_text(c) + text
            logprobs = await self._logprobs(c, echo=self.run.job.echo, start_token=0)
            if self.chat:
                entry = {"index": c.index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs}
            else:
                entry = {"index": c.index, "text": text, "logprobs": logprobs}
            choices.append({**entry, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return {**self.head(False), "choices": choices, "usage": self.usage()}

    # -- chunks ------------------------------------------------------------------------

    async def chunk(self, choice: Choice, first: bool) -> dict | None:
        """What `choice` adds since its last chunk, or `None` if nothing."""
        done = choice.ended or choice.stopped
        text = choice.text.take(finished=done)
        echo = first and self.run.job.echo
        if echo:
            text = self.prompt_text(choice) + text
        end = len(choice.tokens)
        has_tokens = end > choice.logprobs_sent and self.run.job.logprobs is not None
        # Chat opens each choice with its role, as OpenAI does; completions send text only.
        if not (text or done or has_tokens or (first and (self.chat or echo))):
            return None
        logprobs = None
        if has_tokens or echo:
            logprobs = await self._logprobs(choice, echo=echo, start_token=choice.logprobs_sent)
            choice.logprobs_sent = end
        finish = choice.finish_reason if done else None
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            entry = {"index": choice.index, "delta": delta, "logprobs": logprobs}
        else:
            entry = {"index": choice.index, "text": text, "logprobs": logprobs}
        entry.update(finish_reason=finish, stop_reason=choice.stop_reason if done else None)
        body = {**self.head(True), "choices": [entry]}
        if self.run.job.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self) -> dict:
        return {**self.head(True), "choices": [], "usage": self.usage()}

    # -- log-probabilities -------------------------------------------------------------

    async def _logprobs(self, choice: Choice, *, echo: bool, start_token: int) -> dict | None:
        job = self.run.job
        if job.logprobs is None:
            return None
        prompt = job.prompts[choice.prompt]
        first = 1 if echo else len(prompt) + start_token
        end = len(prompt) + len(choice.tokens)
        ids = ([*prompt] if echo else []) + choice.tokens[start_token:]
        scored = await self.run.logprobs(choice, first, end) if end > first else None
        values = _rows(scored, end - first)
        if echo:
            values = [None, *values]
        tokens = [self.tokenizer.decode([t]) for t in ids]
        if self.chat:
            return {"content": [self._chat_entry(tok, v) for tok, v in zip(tokens, values)], "refusal": None}
        offsets = np.cumsum([0, *map(len, tokens)])[:-1].tolist()
        return {
            "tokens": tokens,
            "token_logprobs": [None if v is None else v[0] for v in values],
            "top_logprobs": [None if v is None else self._top(tok, v) for tok, v in zip(tokens, values)],
            "text_offset": offsets,
        }

    def _top(self, token: str, value) -> dict:
        logprob, top = value
        out = {}
        for t, lp in top:
            out.setdefault(self.tokenizer.decode([t]), lp)
        out.setdefault(token, logprob)
        return out

    def _chat_entry(self, token: str, value) -> dict:
        logprob, top = value
        top = [(self.tokenizer.decode([t]), lp) for t, lp in top]
        return {
            "token": token, "logprob": logprob, "bytes": list(token.encode()),
            "top_logprobs": [{"token": s, "logprob": lp, "bytes": list(s.encode())} for s, lp in top],
        }  # fmt: skip


def _rows(scored: TokenLogprobs | None, count: int) -> list:
    """`(logprob, [(top id, top logprob), ...])` per scored position, as plain floats
    (clamped at -9999, as vLLM does, so that JSON never holds -inf)."""
    if scored is None:
        return []
    lp = np.maximum(scored.logprobs, -9999.0).tolist()
    ids, tops = scored.top_ids.tolist(), np.maximum(scored.top_logprobs, -9999.0).tolist()
    return [(lp[i], list(zip(ids[i], tops[i]))) for i in range(count)]
