"""The bytes each token id spells, read from a `tokenizers.Tokenizer`'s decoder.

Stop strings are matched on these bytes (`eqrope.StopStrings`), as transformers'
`StopStringCriteria` matches them: a byte-level BPE (GPT-2, Llama 3, Qwen) maps each
character of a token back to its byte; a SentencePiece-style vocabulary (Llama 2, Mistral)
reads `<0xNN>` byte tokens as that byte and its word marker `▁` as a space. A token in the
middle of a multi-byte character spells its own bytes, so a match never depends on where
the tokens split a character. Special tokens spell nothing (`b""`): `generate_text`
skips them in its text.
"""

import functools
import json
import re

import tokenizers


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's `bytes_to_unicode`, inverted: the character that stands for each byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars)}


def _steps(decoder: dict | None) -> list[dict]:
    """The decoder's steps in order (a `Sequence` decoder flattened)."""
    if not decoder:
        return []
    if decoder.get("type") == "Sequence":
        return [step for d in decoder.get("decoders", []) for step in _steps(d)]
    return [decoder]


def token_bytes(tokenizer: tokenizers.Tokenizer) -> list[bytes]:
    """The bytes of every token id of `tokenizer`, added tokens included (see the module's
    docstring); `b""` for special tokens."""
    state = json.loads(tokenizer.to_str())
    steps = _steps(state.get("decoder"))
    kinds = {step.get("type") for step in steps}
    special = {t["id"]: t for t in state.get("added_tokens", [])}
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    out = [b""] * size
    alphabet = _byte_level_alphabet()
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    # For other decoders, a token's text is what it adds after a plain token (transformers'
    # `StopStringCriteria.clean_tokenizer_vocab`): `" cat"` after `"the"` for a word-level
    # vocabulary that joins words with spaces, `"ing"` for WordPiece's `"##ing"`.
    plain = next((i for i in sorted(vocab.values()) if i not in special), None)
    lead = tokenizer.decode([plain], skip_special_tokens=False) if plain is not None else ""
    for piece, i in vocab.items():
        if i in special:
            out[i] = b"" if special[i].get("special") else piece.encode()
        elif "ByteLevel" in kinds and all(c in alphabet for c in piece):
            out[i] = bytes(alphabet[c] for c in piece)
        elif "ByteFallback" in kinds and _BYTE_TOKEN.fullmatch(piece):
            out[i] = bytes([int(piece[3:5], 16)])
        elif kinds & {"Replace", "Metaspace", "ByteFallback", "Fuse", "Strip"}:
            out[i] = _replaced(piece, steps).encode()
        else:
            text = tokenizer.decode([plain, i], skip_special_tokens=False)
            out[i] = (text[len(lead) :] if text.startswith(lead) else text).encode()
    return out


def _replaced(piece: str, steps: list[dict]) -> str:
    """`piece` through the decoder's `Replace` and `Metaspace` steps (SentencePiece's `▁`
    as a space), not its `Strip` of the text's first space: a token keeps its bytes."""
    for step in steps:
        if step.get("type") == "Replace":
            pattern = step.get("pattern", {})
            if "String" in pattern:
                piece = piece.replace(pattern["String"], step.get("content", ""))
        elif step.get("type") == "Metaspace":
            piece = piece.replace(step.get("replacement", "\u2581"), " ")
    return piece
