"""`eqrope.generate_text`: text in, text out, around `eqrope.generate`."""

from collections.abc import Sequence

import numpy as np

from ._generate import generate
from ._tokenizer import Tokenizer


# Arguments of `generate` that `generate_text` sets itself.
_OWN = ("eos_id", "prompt_lengths", "return_logprobs")


def generate_text(
    model, tokenizer: Tokenizer, prompt: str | Sequence[str], max_new: int, **sampling
) -> str | list[str]:
    """Generate up to `max_new` tokens after a text prompt, and return the new text.

    **Arguments:**

    - `model`: a model for [`eqrope.generate`][] whose vocabulary covers the tokenizer's.
    - `tokenizer`: an [`eqrope.Tokenizer`][]. Prompts are encoded with its special-token
      rules (a BOS token, say).
    - `prompt`: a string, or a list of strings, which run as one ragged batch
      (`Tokenizer.encode_batch` and `prompt_lengths`).
    - `max_new`: the most tokens to add to each prompt.
    - `sampling`: any other keyword of `eqrope.generate` (`temperature`, `top_k`, `top_p`,
      `key`, `max_len`, ...), except `eos_id`, `prompt_lengths` and `return_logprobs`,
      which `generate_text` sets. A string prompt samples as `generate` does with a 1-D
      prompt and the same `key`; a list as a batch.

    **Returns:** the new text of each prompt (a string for a string, a list for a list),
    decoded with `skip_special_tokens=True` and ended before the first of the tokenizer's
    `eos_ids`.

    Each row stops generating at the first of the tokenizer's EOS ids (Llama-3 instruct
    lists three): they all go to `generate` as `eos_id`.
    """
    taken = sorted(set(_OWN) & set(sampling))
    if taken:
        raise TypeError(f"generate_text sets {taken} itself; pass the tokenizer's eos_ids instead.")
    if isinstance(prompt, str):
        ids, lengths = np.asarray(tokenizer.encode(prompt), np.int32), None
    else:
        prompt = list(prompt)
        if not prompt:
            return []
        ids, lengths = tokenizer.encode_batch(prompt)
    eos_ids = tokenizer.eos_ids
    eos_id = list(eos_ids) if eos_ids else None
    result = generate(
        model, ids, max_new, eos_id=eos_id, prompt_lengths=lengths, return_logprobs=True, **sampling
    )
    tokens = np.atleast_2d(np.asarray(result.tokens))
    starts = [len(ids)] if lengths is None else lengths
    ends = np.atleast_1d(np.asarray(result.lengths))
    texts = [
        tokenizer.decode(_until(row[start:end], eos_ids), skip_special_tokens=True)
        for row, start, end in zip(tokens, starts, ends)
    ]
    return texts[0] if isinstance(prompt, str) else texts


def _until(new: np.ndarray, eos_ids: tuple[int, ...]) -> np.ndarray:
    """`new` up to (not including) its first token in `eos_ids`."""
    hits = np.flatnonzero(np.isin(new, eos_ids))
    return new[: hits[0]] if hits.size else new
