"""The server's `TextStream` (serving/server/_text.py): incremental text and stop strings.

Checked against independent references: the tokenizer's full decode of prompt + tokens
(less the prompt's decode), and, for stop strings, a search of the decoded text of every
prefix of the tokens, position by position, for any prompt and tokens (hypothesis), on a
byte-level BPE trained on text with multi-byte characters and a Metaspace (SentencePiece-
like) BPE (tests/_text_tokenizers.py; no downloads). The hand-written examples and the
errors: tests/test_serve_text_examples.py.
"""

import pytest
from hypothesis import given, settings, strategies as st

from _text_tokenizers import SENTENCES, SPECIAL, byte_level, metaspace, reference
from eqrope.serving.server._text import TextStream


def prompts(tok) -> list[list[int]]:
    """Prompts whose text is whole characters: none, only special tokens, plain text, and
    text followed by more special tokens than the detokenizer's context (5)."""
    bos, eos = (tok.tokenizer.token_to_id(s) for s in SPECIAL)
    return [
        [],
        [bos],
        tok.encode("the cat"),
        tok.encode("日本語 🙂"),
        [bos, *tok.encode("héllo")],
        [*tok.encode("hello wörld"), *[eos] * 7],
    ]


def interesting_ids(tok) -> list[int]:
    """Special tokens, and tokens whose own text is not whole characters (byte-level
    pieces of é, 日, 🙂, alone or after an ASCII letter)."""
    raw = tok.tokenizer
    pieces = [i for i in range(tok.vocab_size) if "\ufffd" in raw.decode([i])]
    return pieces + [raw.token_to_id(s) for s in SPECIAL]


# Built once, at import: hypothesis refuses strategies that train a tokenizer on first use.
TOKENIZERS = {"byte_level": byte_level(), "metaspace": metaspace()}
INTERESTING = {name: interesting_ids(tok) for name, tok in TOKENIZERS.items()}
TEXT_IDS = {name: sorted({i for s in SENTENCES for i in tok.encode(s)}) for name, tok in TOKENIZERS.items()}
PROMPTS = {name: prompts(tok) for name, tok in TOKENIZERS.items()}


@st.composite
def cases(draw, max_size=24):
    name = draw(st.sampled_from(sorted(TOKENIZERS)))
    tok = TOKENIZERS[name]
    token = st.one_of(
        st.integers(0, tok.vocab_size - 1), st.sampled_from(INTERESTING[name]), st.sampled_from(TEXT_IDS[name])
    )
    prompt = draw(st.sampled_from(PROMPTS[name]))
    gen = draw(st.lists(token, max_size=max_size))
    return tok, prompt, gen


def run(stream, gen, take_after, *, check=None):
    """Push `gen` (until a push returns True), taking after the pushes `take_after` marks;
    `check(k, stream, taken)` after each push. Returns (push results, takes)."""
    results, takes = [], []
    for k, token in enumerate(gen, start=1):
        results.append(stream.push(token))
        if take_after[k % len(take_after)]:
            takes.append(stream.take())
        if check is not None:
            check(k, stream, "".join(takes))
        if results[-1]:
            break
    takes.append(stream.take(finished=True))
    return results, takes


# --- Without stop strings: the text is the full decode ------------------------------------


@settings(max_examples=150, deadline=None)
@given(case=cases(), take_after=st.lists(st.booleans(), min_size=1, max_size=5))
def test_text_is_the_full_decode_less_the_prompt(case, take_after):
    tok, prompt, gen = case
    final = reference(tok, prompt, gen)

    def check(k, stream, taken):
        # After k tokens: the decode of the first k, less a final incomplete character.
        assert stream.text == reference(tok, prompt, gen[:k]).rstrip("\ufffd")
        assert stream.tokens == k
        # What was sent is final: never a U+FFFD that would later become a character.
        assert not taken.endswith("\ufffd")
        assert final.startswith(taken)

    stream = TextStream(tok, prompt)
    results, takes = run(stream, gen, take_after, check=check)
    assert not any(results) and stream.stopped is None
    assert "".join(takes) == stream.text == final
    assert stream.take() == stream.take(finished=True) == ""


@settings(max_examples=150, deadline=None)
@given(
    name=st.sampled_from(sorted(TOKENIZERS)),
    data=st.data(),
    skip=st.booleans(),
)
def test_any_prompt_whose_text_the_full_decode_starts_with(name, data, skip):
    """Random prompts too, cut inside characters, of special tokens: the promise holds
    whenever decode(prompt + gen) starts with decode(prompt)."""
    tok = TOKENIZERS[name]
    token = st.one_of(st.integers(0, tok.vocab_size - 1), st.sampled_from(INTERESTING[name]))
    prompt = data.draw(st.lists(token, max_size=12))
    gen = data.draw(st.lists(token, max_size=16))
    full = tok.decode(prompt + gen, skip_special_tokens=skip)
    head = tok.decode(prompt, skip_special_tokens=skip)
    stream = TextStream(tok, prompt, skip_special_tokens=skip)
    for token in gen:
        stream.push(token)
    text = stream.take(finished=True)
    assert text == stream.text
    if full.startswith(head):
        assert text == full[len(head) :]


# --- Stop strings ---------------------------------------------------------------------------


def first_stop(tok, prompt, gen, stops, min_tokens=0):
    """(k, text, stop): the first k > min_tokens whose decoded text holds a stop string
    ending past the text of the first `min_tokens` tokens, that text cut at the match that
    starts first (the first listed at a tie); None if there is none."""
    floor = len(reference(tok, prompt, gen[:min_tokens]).rstrip("\ufffd"))
    for k in range(min_tokens + 1, len(gen) + 1):
        text = reference(tok, prompt, gen[:k])
        hits = [
            (i, order, s)
            for order, s in enumerate(stops)
            for i in range(len(text))
            if text.startswith(s, i) and i + len(s) > floor
        ]
        if hits:
            i, _, s = min(hits)
            return k, text[:i], s
    return None


@st.composite
def stop_cases(draw):
    tok, prompt, gen = draw(cases(max_size=16))
    text = reference(tok, prompt, gen)
    stops = []
    for _ in range(draw(st.integers(1, 3))):
        if text and draw(st.booleans()):  # a piece of the text, so that it matches
            i = draw(st.integers(0, len(text) - 1))
            s = text[i : i + draw(st.integers(1, 5))]
        else:
            s = draw(st.text(alphabet="aehlmostw .,é日本語🙂", min_size=1, max_size=4))
        s = s.rstrip("\ufffd")
        if s:
            stops.append(s)
    if not stops:
        stops = ["mat"]
    return tok, prompt, gen, tuple(stops)


@settings(max_examples=200, deadline=None)
@given(
    case=stop_cases(),
    min_tokens=st.sampled_from([0, 0, 1, 3]),
    take_after=st.lists(st.booleans(), min_size=1, max_size=5),
)
def test_stop_strings_against_a_search_of_every_prefix(case, min_tokens, take_after):
    tok, prompt, gen, stops = case
    want = first_stop(tok, prompt, gen, stops, min_tokens)
    hold = max(map(len, stops)) - 1

    def check(k, stream, taken):
        # Sent text is final and leaves out the last characters that could begin a stop:
        # a take sends all the text but those.
        assert stream.text.startswith(taken)
        if stream.stopped is None:
            bound = max(0, len(stream.text) - hold)
            assert (len(taken) == bound) if take_after[k % len(take_after)] else (len(taken) <= bound)

    stream = TextStream(tok, prompt, stops, min_tokens=min_tokens)
    results, takes = run(stream, gen, take_after, check=check)
    assert "".join(takes) == stream.text
    if want is None:
        assert not any(results) and stream.stopped is None
        assert stream.tokens == len(gen) and stream.text == reference(tok, prompt, gen)
    else:
        k, text, stop = want
        assert results == [False] * (k - 1) + [True]
        assert (stream.tokens, stream.text, stream.stopped) == (k, text, stop)
        if k < len(gen):
            with pytest.raises(RuntimeError, match="already ended at stop string"):
                stream.push(gen[k])
