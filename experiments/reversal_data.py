"""The string-reversal task of the textbook's chapters 1 and 2.

A string of letters is followed by a separator and then the same letters in reverse order:
`c a f SEP f a c`. The model reads the string and the separator and must write the
reversal. Token ids:

- `0 .. 9`: the ten letters `a .. j`;
- `10`: `SEP`, the separator;
- `11`: `PAD`, filling a training row after its end (never a target, never in a prompt).

That is a vocabulary of 12. The longest string, 12 letters, makes a sequence of
`12 + 1 + 12 = 25` tokens, the models' `max_len`.

Everything here is NumPy on the host, drawn from a `numpy.random.Generator`, so a seed
fixes the data exactly.
"""

import numpy as np


N_LETTERS = 10
SEP = 10
PAD = 11
VOCAB_SIZE = 12
MAX_STRING = 12
MAX_LEN = 2 * MAX_STRING + 1
LETTERS = "abcdefghij"


def parse_lengths(text: str) -> tuple[int, ...]:
    """`"3-8,11-12"` -> `(3, 4, 5, 6, 7, 8, 11, 12)`; also single lengths like `"9"`."""
    lengths: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        low, _, high = part.partition("-")
        try:
            low_i, high_i = int(low), int(high or low)
        except ValueError:
            raise ValueError(
                f"lengths must look like '3-8' or '3-8,11-12', got {text!r}."
            ) from None
        if low_i > high_i:
            raise ValueError(f"lengths: range {part!r} is empty; write it low-high.")
        lengths.extend(range(low_i, high_i + 1))
    if not lengths:
        raise ValueError(f"lengths: no lengths in {text!r}; write e.g. '3-8'.")
    bad = [n for n in lengths if not 1 <= n <= MAX_STRING]
    if bad:
        raise ValueError(
            f"lengths must be between 1 and {MAX_STRING} (the models' max_len is {MAX_LEN}), "
            f"got {bad}."
        )
    return tuple(sorted(set(lengths)))


def random_strings(
    rng: np.random.Generator, n: int, lengths: tuple[int, ...]
) -> list[np.ndarray]:
    """`n` strings, each of a length drawn uniformly from `lengths`, letters uniform."""
    sizes = rng.choice(np.asarray(lengths), size=n)
    return [rng.integers(0, N_LETTERS, size=int(s)).astype(np.int32) for s in sizes]


def encode(string: np.ndarray) -> np.ndarray:
    """The full sequence `string, SEP, reversed(string)`, of length `2 * len + 1`."""
    return np.concatenate([string, [SEP], string[::-1]]).astype(np.int32)


def decode(ids) -> str:
    """Token ids as text: letters, `|` for SEP, `.` for PAD."""
    return "".join(LETTERS[i] if i < N_LETTERS else ("|" if i == SEP else ".") for i in ids)


def training_batch(
    rng: np.random.Generator, batch: int, lengths: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A batch padded to `MAX_LEN` for next-token training on the answer only.

    **Returns:** `(ids, targets, mask)`, each `(batch, MAX_LEN)`. `targets[b, t]` is the
    token after `ids[b, t]`. `mask[b, t]` is 1 exactly where `targets[b, t]` is a letter of
    the reversed string: positions `L .. 2L - 1` for a string of length `L` (the SEP and
    the `L - 1` answer letters before the last are the inputs that predict them).
    """
    ids = np.full((batch, MAX_LEN), PAD, np.int32)
    targets = np.full((batch, MAX_LEN), PAD, np.int32)
    mask = np.zeros((batch, MAX_LEN), np.float32)
    for b, string in enumerate(random_strings(rng, batch, lengths)):
        seq = encode(string)
        n = len(string)
        ids[b, : len(seq)] = seq
        targets[b, : len(seq) - 1] = seq[1:]
        mask[b, n : 2 * n] = 1.0
    return ids, targets, mask


def prompts(strings: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded prompts `string, SEP` and their lengths, for batched generation.

    **Returns:** `(prompt, lengths)` of shapes `(n, longest + 1)` and `(n,)`.
    """
    width = max(len(s) for s in strings) + 1
    out = np.full((len(strings), width), PAD, np.int32)
    lengths = np.zeros((len(strings),), np.int32)
    for i, s in enumerate(strings):
        out[i, : len(s)] = s
        out[i, len(s)] = SEP
        lengths[i] = len(s) + 1
    return out, lengths


def answers_correct(tokens: np.ndarray, strings: list[np.ndarray]) -> np.ndarray:
    """Exact match: row `i` of `tokens` holds `strings[i], SEP` and then its reversal.

    Only the `L` tokens after the separator are compared; what the model writes after
    them does not count.
    """
    tokens = np.asarray(tokens)
    ok = np.zeros((len(strings),), bool)
    for i, s in enumerate(strings):
        n = len(s)
        ok[i] = np.array_equal(tokens[i, n + 1 : 2 * n + 1], s[::-1])
    return ok
