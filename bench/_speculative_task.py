"""The task of bench/speculative.py: a small character-level language and a copying task
in its alphabet (its trained target/draft pair: `_speculative_pair.py`).

**The language.** Sentences of a template grammar,

    DET [ADJ] NOUN VERB DET [ADJ] NOUN [PREP DET PLACE] "."

over a lexicon of 36 words, written with the 26 letters, the space and the period. The
spelling inside a word is fixed, so once a word's first letter or two are known the rest
is certain; the choice of each word is not: the verb depends on the subject noun, the
object on the verb, the place on the preposition (each through a table of probabilities
drawn once from `GRAMMAR_SEED`), the adjectives and the phrase are optional. Its entropy
is 0.348 nats per character (`entropy_per_char`). A one-block draft predicts the letters
inside words as the target does (99% of them), the first letter of a word less often
(85%).

**The copying task.** `TEXT|TEXT ...`: one or two sentences of the language (at most
`COPY_MAX` characters), the separator `|`, the same text again, then more sentences.
After the separator the characters are certain for a model that copies, and prompt
lookup (matching the text's last characters earlier in it) drafts them too.

Everything here is NumPy on the host, drawn from a `numpy.random.Generator`, so a seed
fixes the data exactly.
"""

import dataclasses

import numpy as np


ALPHABET = " .|abcdefghijklmnopqrstuvwxyz"
SPACE, PERIOD, SEP = 0, 1, 2
VOCAB_SIZE = len(ALPHABET)  # 29
MAX_LEN = 256  # the models' positions
TRAIN_LEN = 128  # characters per training row
COPY_MAX = 63  # the longest copied text, so that `text|text` fits a training row
COPY_FRACTION = 0.5
GRAMMAR_SEED = 2025

DETERMINERS = ("the", "a", "my")
ADJECTIVES = ("big", "small", "red", "old", "happy", "quiet")
NOUNS = ("cat", "dog", "bird", "fish", "man", "girl", "king", "horse", "farmer", "teacher")
VERBS = ("sees", "eats", "likes", "chases", "finds", "hears", "follows", "paints")
PREPOSITIONS = ("in", "near", "under", "with")
PLACES = ("house", "river", "tree", "garden", "park")

P_ADJECTIVE = 0.35
P_PHRASE = 0.3
P_DETERMINER = np.array([0.6, 0.3, 0.1])

@dataclasses.dataclass(frozen=True)
class Grammar:
    """The probability tables of the language, each row summing to 1: `subject` over
    `NOUNS`, `verb[noun]` over `VERBS`, `object[verb]` over `NOUNS`, `place[prep]` over
    `PLACES`; adjectives and prepositions are uniform."""

    subject: np.ndarray  # (nouns,)
    verb: np.ndarray  # (nouns, verbs)
    object: np.ndarray  # (verbs, nouns)
    place: np.ndarray  # (prepositions, places)


def make_grammar(seed: int = GRAMMAR_SEED) -> Grammar:
    """The language's tables: a Zipf law over subjects, Dirichlet(0.5) rows elsewhere (so
    most contexts have two or three likely words)."""
    rng = np.random.default_rng(seed)
    zipf = 1.0 / np.arange(1, len(NOUNS) + 1)
    return Grammar(
        subject=rng.permutation(zipf / zipf.sum()),
        verb=rng.dirichlet(np.full(len(VERBS), 0.5), size=len(NOUNS)),
        object=rng.dirichlet(np.full(len(NOUNS), 0.5), size=len(VERBS)),
        place=rng.dirichlet(np.full(len(PLACES), 0.5), size=len(PREPOSITIONS)),
    )


def _entropy(p: np.ndarray) -> float:
    p = p[p > 0]
    return float(-np.sum(p * np.log(p)))


def entropy_per_char(grammar: Grammar) -> float:
    """The language's entropy rate in nats per character: a sentence's entropy over its
    expected length (with the space after it), the best loss on a long run of sentences."""
    lengths = lambda words: np.array([len(w) for w in words], np.float64)
    uniform = lambda n: np.full(n, 1.0 / n)
    verb = grammar.subject @ grammar.verb
    obj = verb @ grammar.object
    place = uniform(len(PREPOSITIONS)) @ grammar.place
    adjective = (_entropy(np.array([1 - P_ADJECTIVE, P_ADJECTIVE]))
                 + P_ADJECTIVE * np.log(len(ADJECTIVES)))
    phrase = _entropy(np.array([1 - P_PHRASE, P_PHRASE])) + P_PHRASE * (
        np.log(len(PREPOSITIONS)) + _entropy(P_DETERMINER)
        + np.mean([_entropy(row) for row in grammar.place]))
    nats = (2 * _entropy(P_DETERMINER) + 2 * adjective + _entropy(grammar.subject)
            + grammar.subject @ [_entropy(row) for row in grammar.verb]
            + verb @ [_entropy(row) for row in grammar.object] + phrase)
    det = P_DETERMINER @ lengths(DETERMINERS) + 1
    adjectives = P_ADJECTIVE * (lengths(ADJECTIVES).mean() + 1)
    chars = (2 * det + 2 * adjectives + grammar.subject @ lengths(NOUNS) + 1
             + verb @ lengths(VERBS) + 1 + obj @ lengths(NOUNS) + 2  # the period and a space
             + P_PHRASE * (lengths(PREPOSITIONS).mean() + 1 + det + place @ lengths(PLACES) + 1))
    return float(nats / chars)


def encode(text: str) -> np.ndarray:
    """Characters of `ALPHABET` as int32 ids."""
    bad = sorted(set(text) - set(ALPHABET))
    if bad:
        raise ValueError(f"characters {bad} are not in the alphabet {ALPHABET!r}.")
    return np.array([ALPHABET.index(c) for c in text], np.int32)


def decode(ids) -> str:
    """Ids as text; an id outside the alphabet shows as `?`."""
    return "".join(ALPHABET[i] if 0 <= i < VOCAB_SIZE else "?" for i in np.asarray(ids).tolist())


def sentence(grammar: Grammar, rng: np.random.Generator) -> str:
    """One sentence of the language, ending with its period (no trailing space)."""

    def noun_phrase(nouns_p):
        words = [DETERMINERS[rng.choice(3, p=P_DETERMINER)]]
        if rng.random() < P_ADJECTIVE:
            words.append(ADJECTIVES[rng.integers(len(ADJECTIVES))])
        noun = rng.choice(len(nouns_p), p=nouns_p)
        return words, noun

    subject, noun = noun_phrase(grammar.subject)
    verb = rng.choice(len(VERBS), p=grammar.verb[noun])
    obj, other = noun_phrase(grammar.object[verb])
    words = subject + [NOUNS[noun], VERBS[verb]] + obj + [NOUNS[other]]
    if rng.random() < P_PHRASE:
        prep = rng.integers(len(PREPOSITIONS))
        place = rng.choice(len(PLACES), p=grammar.place[prep])
        words += [PREPOSITIONS[prep], DETERMINERS[rng.choice(3, p=P_DETERMINER)], PLACES[place]]
    return " ".join(words) + "."


def text(grammar: Grammar, rng: np.random.Generator, min_chars: int) -> str:
    """Sentences joined by spaces until there are at least `min_chars` characters."""
    out = sentence(grammar, rng)
    while len(out) < min_chars:
        out += " " + sentence(grammar, rng)
    return out


def copy_text(grammar: Grammar, rng: np.random.Generator) -> str:
    """The text of a copying example: one or two sentences, at most `COPY_MAX` characters."""
    first = sentence(grammar, rng)
    while len(first) > COPY_MAX:  # never for this lexicon (at most 60), kept for safety
        first = sentence(grammar, rng)
    if rng.random() < 0.5:
        both = first + " " + sentence(grammar, rng)
        if len(both) <= COPY_MAX:
            return both
    return first


def training_batch(grammar: Grammar, rng: np.random.Generator, batch: int,
                   length: int = TRAIN_LEN, copy_fraction: float = COPY_FRACTION
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`(ids, targets, mask)`, each `(batch, length)`, from rows of `length + 1` characters
    (`targets[:, t] = ids[:, t + 1]`); ids and targets int32, mask bool.

    A row is a run of sentences (its mask all true), or, with probability `copy_fraction`,
    `copy_text | copy_text` and then a run of sentences, whose mask keeps only the copy
    and the space after it: with the language's loss on the whole of a copying row, the
    model learns to predict the copy as language and copies nothing (seen at 400 steps),
    while the copy's loss alone teaches copying in a few hundred steps. Every row starts
    at the start of a sentence.
    """
    rows = np.empty((batch, length + 1), np.int32)
    mask = np.ones((batch, length), bool)
    for i in range(batch):
        row = ""
        if rng.random() < copy_fraction:
            copied = copy_text(grammar, rng)
            row = copied + ALPHABET[SEP] + copied + " "
            mask[i] = False
            mask[i, len(copied) : 2 * len(copied) + 1] = True  # targets: the copy, the space
        row += text(grammar, rng, length + 1 - len(row))
        rows[i] = encode(row[: length + 1])
    return rows[:, :-1], rows[:, 1:], mask


# -- membership: which strings the grammar can write -------------------------------------


def _templates() -> list[list[tuple[str, ...]]]:
    """The word lists of each slot, for the 8 shapes of a sentence (each adjective and the
    phrase in or out)."""
    out = []
    for adjective_1 in (0, 1):
        for adjective_2 in (0, 1):
            for phrase in (0, 1):
                out.append([DETERMINERS, *[ADJECTIVES] * adjective_1, NOUNS, VERBS, DETERMINERS,
                            *[ADJECTIVES] * adjective_2, NOUNS,
                            *[PREPOSITIONS, DETERMINERS, PLACES] * phrase])
    return out


_TEMPLATES = _templates()


def is_sentence(string: str, *, complete: bool = True) -> bool:
    """Whether `string` is a sentence of the language (ending with its period), or with
    `complete=False` the start of one: whole words, each followed by a space, and then
    perhaps the start of a word (or the whole sentence)."""
    if string.endswith("."):
        words = string[:-1].split(" ")
        return any(len(t) == len(words) and all(w in slot for w, slot in zip(words, t))
                   for t in _TEMPLATES)
    if complete:
        return False
    *whole, last = string.split(" ")
    return any(len(t) > len(whole) and all(w in slot for w, slot in zip(whole, t))
               and any(w.startswith(last) for w in t[len(whole)]) for t in _TEMPLATES)


def is_text(string: str, *, complete: bool = True) -> bool:
    """Whether `string` is sentences of the language joined by single spaces; with
    `complete=False` the last one may be cut anywhere (and may end with a space)."""
    *whole, last = string.split(". ")
    if not all(is_sentence(p + ".") for p in whole):
        return False
    if complete:
        return is_sentence(last)
    return last == "" or is_sentence(last, complete=False)


# -- benchmark prompts --------------------------------------------------------------------


def _pad(rows: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.array([len(r) for r in rows], np.int32)
    out = np.full((len(rows), int(lengths.max())), SPACE, np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out, lengths


def language_prompts(n: int, seed: int = 0, grammar: Grammar | None = None
                     ) -> tuple[np.ndarray, np.ndarray]:
    """`n` prompts that start a sentence: its first one to three words and a space.

    **Returns:** `(prompts, lengths)`: int32 `(n, longest)` padded on the right with spaces,
    and int32 `(n,)`.
    """
    grammar = make_grammar() if grammar is None else grammar
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        words = sentence(grammar, rng).split(" ")
        rows.append(encode(" ".join(words[: rng.integers(1, 4)]) + " "))
    return _pad(rows)


def copy_prompts(n: int, seed: int = 0, given: int = 2, grammar: Grammar | None = None
                 ) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """`n` copying prompts: a text, the separator, and the text's first `given` characters.

    **Returns:** `(prompts, lengths, texts)`: int32 `(n, longest)` padded on the right with
    spaces, int32 `(n,)`, and each prompt's text (what a copying model writes after the
    separator, of which the prompt already holds the first `given` characters).
    """
    grammar = make_grammar() if grammar is None else grammar
    rng = np.random.default_rng(seed)
    texts = [copy_text(grammar, rng) for _ in range(n)]
    rows = [encode(t + ALPHABET[SEP] + t[:given]) for t in texts]
    return (*_pad(rows), texts)
