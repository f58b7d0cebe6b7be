"""The tokenizers of tests/test_serve_text*.py, built without downloads (a byte-level BPE
trained on text with multi-byte characters, a Metaspace BPE), and the reference text of
new tokens: the full decode less the prompt's."""

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

import eqrope


SENTENCES = [
    "héllo wörld 日本語 🙂",
    "the cat sat on the mat.",
    "hello world, hello again",
    "wörld of 日本 and 語; héllo 🙂🙂",
    "mat....... sat, cat; the end",
]
SPECIAL = ["<s>", "</s>"]


def byte_level() -> eqrope.Tokenizer:
    raw = tokenizers.Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=330, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )  # fmt: skip
    raw.train_from_iterator(SENTENCES * 3, trainer)
    return eqrope.Tokenizer(raw, eos_ids=(raw.token_to_id("</s>"),))


def metaspace() -> eqrope.Tokenizer:
    raw = tokenizers.Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=SPECIAL, show_progress=False)
    raw.train_from_iterator(SENTENCES * 3, trainer)
    return eqrope.Tokenizer(raw, eos_ids=(raw.token_to_id("</s>"),))


def reference(tok, prompt, gen, skip=True) -> str:
    """decode(prompt + gen) less decode(prompt), for prompts whose text it starts with."""
    full = tok.decode(list(prompt) + list(gen), skip_special_tokens=skip)
    head = tok.decode(list(prompt), skip_special_tokens=skip)
    assert full.startswith(head)
    return full[len(head) :]
