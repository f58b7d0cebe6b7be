"""The server's `TextStream` (serving/server/_text.py) on hand-written vocabularies: stop
strings, holding back what could begin one, `min_tokens`, Metaspace's first space, special
tokens, characters split over byte tokens, ids past the vocabulary; and its errors. Each
expected text is written out by hand or is the tokenizer's full decode.
"""

import functools

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

import eqrope
from _text_tokenizers import SPECIAL, reference
from eqrope.serving.server._text import TextStream


@functools.cache
def words() -> eqrope.Tokenizer:
    """A Metaspace vocabulary written out, so that each example's tokens are explicit."""
    vocab = SPECIAL + ["▁The", "▁cat", "▁sat", "▁on", "▁the", "▁m", "a", "t.", ".", "▁mat...."]
    raw = tokenizers.Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(vocab)}, merges=[]))
    raw.add_special_tokens(SPECIAL)
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Metaspace()
    return eqrope.Tokenizer(raw, eos_ids=(1,))


def ids(*pieces: str) -> list[int]:
    return [words().tokenizer.token_to_id(p) for p in pieces]


def gpt2_byte_chars() -> dict[int, str]:
    """GPT-2's byte-to-character table, which the byte-level (de)coder uses."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b) if b in kept else chr(next(extra)) for b in range(256)}


@functools.cache
def bytes_vocab() -> eqrope.Tokenizer:
    """Every byte a token, and a few tokens that end or start inside a character."""
    table = gpt2_byte_chars()
    pieces = [bytes([b]) for b in range(256)] + [b"h\xc3", b"\xa9llo", b" \xe6\x97", b"\xa5x"]
    vocab = {"".join(table[b] for b in p): i for i, p in enumerate(pieces)}
    raw = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    raw.decoder = decoders.ByteLevel()
    return eqrope.Tokenizer(raw)


def byte_ids(*pieces: bytes) -> list[int]:
    table = gpt2_byte_chars()
    return [bytes_vocab().tokenizer.token_to_id("".join(table[b] for b in p)) for p in pieces]


def stream_all(tok, prompt, gen, stop=(), **kwargs):
    stream = TextStream(tok, prompt, stop, **kwargs)
    pushed = [stream.push(t) for t in gen if stream.stopped is None]
    return stream, pushed


PROMPT = ["▁The", "▁cat"]


@pytest.mark.parametrize(
    "gen, stop, tokens, text, stopped",
    [
        # "mat" spans three tokens (" m", "a", "t."); the text is cut at its start.
        (["▁sat", "▁on", "▁the", "▁m", "a", "t.", ".", "."], ("mat",), 6, " sat on the ", "mat"),
        # ... or lies inside one token, with text after it.
        (["▁sat", "▁on", "▁the", "▁mat....", "."], ("mat",), 4, " sat on the ", "mat"),
        # The first stop string to complete ends the text, though a longer one begins earlier.
        (["▁sat", "▁on", "▁the", "▁m", "a", "t."], ("on the mat", "the"), 3, " sat on ", "the"),
        # Two complete at the same token: the one that starts first.
        (["▁sat", "▁on", "▁the", "▁mat...."], ("t....", "the mat"), 4, " sat on ", "the mat"),
        # A stop string across a space: " m" starts it inside the token "▁m".
        (["▁sat", "▁on", "▁the", "▁m", "a"], ("e ma",), 5, " sat on th", "e ma"),
        # No match: the whole text.
        (["▁sat", "▁on", "▁the", "▁m", "a"], ("dog",), 5, " sat on the ma", None),
    ],
)
def test_stop_string_examples(gen, stop, tokens, text, stopped):
    stream, pushed = stream_all(words(), ids(*PROMPT), ids(*gen), stop)
    assert (stream.tokens, stream.text, stream.stopped) == (tokens, text, stopped)
    assert pushed == [False] * (tokens - 1) + [stopped is not None]
    assert stream.take(finished=True) == text


def test_takes_hold_back_what_could_begin_a_stop_string():
    stream = TextStream(words(), ids(*PROMPT), ("mat", "t...."))  # holds back 4 characters
    pieces = []
    for token in ids("▁sat", "▁on", "▁the", "▁m", "a", "t."):
        stream.push(token)
        pieces.append(stream.take())
    # " sat" sends nothing, " sat on" sends " sa", " sat on the" "t on", and so on; at
    # "t." the stop string "mat" completes, and what is left before it is sent.
    assert pieces == ["", " sa", "t on", " t", "h", "e "]
    assert stream.stopped == "mat" and stream.take() == stream.take(finished=True) == ""
    assert "".join(pieces) == stream.text == " sat on the "


@pytest.mark.parametrize(
    "min_tokens, tokens, text",
    [
        (0, 6, " sat on the "),
        (5, 6, " sat on the "),  # "mat" begins in the first 5 tokens and ends in the 6th
        (6, 7, " sat on the mat. "),  # the first "mat" ends within the first 6 tokens
        (7, 7, " sat on the mat. mat...."),  # no stop string looked for at all
    ],
)
def test_min_tokens_delays_stop_strings(min_tokens, tokens, text):
    gen = ids("▁sat", "▁on", "▁the", "▁m", "a", "t.", "▁mat....")
    stream, _ = stream_all(words(), ids(*PROMPT), gen, ("mat",), min_tokens=min_tokens)
    assert (stream.tokens, stream.text) == (tokens, text)


@pytest.mark.parametrize(
    "prompt, text",
    [
        (["▁The"], " cat sat"),  # the space of the first new token stays
        (["▁The", *["</s>"] * 7], " cat sat"),  # ... behind more special tokens than 5
        ([], "cat sat"),  # the first token of the text drops it, as the full decode does
        (["<s>"], "cat sat"),
    ],
)
def test_metaspace_keeps_the_space_of_the_first_new_token(prompt, text):
    gen = ids("▁cat", "▁sat")
    stream, _ = stream_all(words(), ids(*prompt), gen)
    assert stream.take(finished=True) == text == reference(words(), ids(*prompt), gen)


def test_special_tokens_skipped_or_kept():
    gen = ids("▁cat", "</s>", "▁sat")
    assert stream_all(words(), ids("▁The"), gen)[0].text == " cat sat"
    kept, _ = stream_all(words(), ids("▁The"), gen, skip_special_tokens=False)
    assert kept.take(finished=True) == " cat</s> sat"


def test_a_character_split_over_byte_tokens_comes_out_whole():
    tok = bytes_vocab()
    stream = TextStream(tok, [])
    pieces = []
    for token in byte_ids(b"a", b"\xe6", b"\x97", b"\xa5", b"b"):
        stream.push(token)
        pieces.append(stream.take())
    assert pieces == ["a", "", "", "日", "b"]
    # The text before an incomplete character is sent now ("h" of "h\xc3").
    stream = TextStream(tok, [])
    stream.push(byte_ids(b"h\xc3")[0])
    assert stream.take() == "h"
    stream.push(byte_ids(b"\xa9llo")[0])
    assert stream.take() == "éllo"
    # A stop string found in the text before an incomplete character, at that token.
    stream = TextStream(tok, [], ("h",))
    assert stream.push(byte_ids(b"h\xc3")[0]) and stream.text == "" and stream.tokens == 1
    # A stop string made of the bytes of two tokens.
    stream = TextStream(tok, [], ("日x",))
    assert [stream.push(t) for t in byte_ids(b" \xe6\x97", b"\xa5x")] == [False, True]
    assert stream.text == " "


def test_an_incomplete_character_at_the_end_is_written_as_the_full_decode_writes_it():
    tok = bytes_vocab()
    gen = byte_ids(b"a", b"\xe6", b"\x97")
    stream, _ = stream_all(tok, [], gen)
    assert stream.text == "a" and stream.take() == "a"
    assert stream.take(finished=True) == "\ufffd" == tok.decode(gen)[1:]
    with pytest.raises(RuntimeError, match="finished"):
        stream.push(gen[0])
    # An invalid byte inside the text is written as it is, once what follows arrives.
    stream, _ = stream_all(tok, [], byte_ids(b"\x97", b"a"))
    assert stream.take() == "\ufffda" == tok.decode(byte_ids(b"\x97", b"a"))


def test_a_token_past_the_vocabulary_has_no_text():
    stream = TextStream(words(), ids("▁The"))
    stream.push(words().vocab_size + 10)
    stream.push(ids("▁cat")[0])
    assert (stream.tokens, stream.take(finished=True)) == (2, " cat")


# --- Errors --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(stop="mat"), TypeError, r"wrap one string as \('mat',\)"),
        (dict(stop=("",)), ValueError, "stop strings must be non-empty"),
        (dict(stop=("a", 3)), TypeError, r"stop\[1\] must be a string"),
        (dict(stop={"mat"}), TypeError, "stop must be a tuple of strings, got set"),
        (dict(stop=("a\ufffd",)), ValueError, "ends in U\\+FFFD"),
        (dict(min_tokens=-1), ValueError, "min_tokens must be an int >= 0"),
        (dict(min_tokens=1.0), TypeError, "min_tokens must be an int"),
        (dict(skip_special_tokens="yes"), TypeError, "skip_special_tokens must be True or False"),
        (dict(prompt=[2, -1]), ValueError, "prompt holds a negative token id"),
        (dict(prompt=[[2, 3]]), ValueError, "prompt must have rank 1"),
        (dict(prompt="the cat"), TypeError, "prompt must be an integer array"),
        (dict(tokenizer=None), TypeError, "tokenizer must be an eqrope.Tokenizer"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    args = {"tokenizer": words(), "prompt": ids("▁The"), **kwargs}
    with pytest.raises(error, match=match):
        TextStream(**args)


def test_bad_tokens_and_calls():
    stream = TextStream(words(), ids("▁The"), ("cat",))
    with pytest.raises(ValueError, match="token must be an int >= 0"):
        stream.push(-1)
    with pytest.raises(TypeError, match="token must be an int"):
        stream.push(True)
    with pytest.raises(TypeError, match="finished must be True or False"):
        stream.take(finished=1)
    assert stream.push(ids("▁cat")[0])
    with pytest.raises(RuntimeError, match="already ended at stop string 'cat'"):
        stream.push(ids("▁sat")[0])
    assert stream.tokens == 1
