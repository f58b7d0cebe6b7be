"""`on_token` from inside the compiled loop, and `generate_text(stream=...)`.

The calls are checked against the returned tokens (exactly the new tokens, in order,
for a ragged batch), against the uncached path's calls, and in the compiled program's
HLO: a host callback when streaming, none otherwise.
"""

import jax
import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

import eqrope
from _compiles import counting
from _models import random_model
from eqrope.generation import _decode
from eqrope.generation._request import parse_request
from eqrope.generation._generation_config import GenerationConfig
from eqrope.generation._stream import TextStream
from eqrope.testing import Uncached, hlo_instructions


VOCAB = 29


@pytest.fixture(scope="module")
def model():
    return random_model(1, VOCAB, 16, 2, 1, 64, d_ff=32)


PROMPT = np.array([[1, 2, 3, 4, 5, 6], [7, 8, 9, 0, 0, 0], [10, 11, 0, 0, 0, 0]], np.int32)
LENGTHS = np.array([6, 3, 2], np.int32)


def calls_of(model, *args, **kwargs):
    calls = []
    out = eqrope.generate(model, *args, on_token=lambda *c: calls.append(c), return_logprobs=True, **kwargs)
    return out, calls


@pytest.mark.parametrize("sampling", [{}, dict(temperature=1.0, key=jax.random.key(3))])
def test_on_token_gets_exactly_the_new_tokens_in_order(model, sampling):
    free = np.asarray(eqrope.generate(model, PROMPT, 12, prompt_lengths=LENGTHS, **sampling))
    eos = int(free[1, 3 + 4])  # row 1 stops early, at its fifth new token
    out, calls = calls_of(model, PROMPT, 12, prompt_lengths=LENGTHS, eos_id=eos, **sampling)
    tokens, ends = np.asarray(out.tokens), np.asarray(out.lengths)
    assert ends[1] <= 3 + 5 and ends[0] > ends[1]
    for row in range(3):
        mine = [(p, t) for r, p, t in calls if r == row]
        want = [(p, int(tokens[row, p])) for p in range(LENGTHS[row], ends[row])]
        assert mine == want  # every new token once, the EOS included, in position order
    # Step by step: each step reports the rows still going, in row order.
    steps = [int(p) - LENGTHS[r] for r, p, _ in calls]
    assert steps == sorted(steps)
    # The uncached path calls in the same order.
    _, plain = calls_of(Uncached(model), PROMPT, 12, prompt_lengths=LENGTHS, eos_id=eos, **sampling)
    assert plain == calls


def test_on_token_rows_with_num_samples(model):
    out, calls = calls_of(model, PROMPT[:2], 5, prompt_lengths=LENGTHS[:2], num_samples=2,
                          temperature=1.0, key=jax.random.key(0))  # fmt: skip
    tokens = np.asarray(out.tokens).reshape(4, -1)
    starts = np.repeat(LENGTHS[:2], 2)
    for r, p, t in calls:
        assert p >= starts[r] and tokens[r, p] == t
    assert len(calls) == int(np.sum(np.asarray(out.lengths).reshape(-1) - starts))


def test_a_new_callback_compiles_nothing(model):
    calls_of(model, PROMPT, 4, prompt_lengths=LENGTHS)
    with counting() as c:
        for _ in range(3):
            calls_of(model, PROMPT, 4, prompt_lengths=LENGTHS)
    assert c.traces["generate_program"] == 0


def test_an_exception_in_on_token_is_raised_by_generate(model):
    seen = []

    def on_token(row, pos, token):
        seen.append(token)
        if len(seen) == 2:
            raise KeyError("stop here")

    with pytest.raises(KeyError, match="stop here"):
        eqrope.generate(model, PROMPT[0], 8, on_token=on_token)
    assert len(seen) == 2  # no calls after the exception
    with pytest.raises(TypeError, match="on_token"):
        eqrope.generate(model, PROMPT[0], 8, on_token="print")


def test_on_token_is_refused_under_grad(model):
    def loss(m):
        return eqrope.generate(m, PROMPT[0], 3, on_token=print, return_logprobs=True).logprobs.sum()

    with pytest.raises(ValueError, match="on_token.*jax.grad"):
        jax.grad(loss)(model)


def program_text(model, on_token) -> str:
    request = parse_request(
        model, PROMPT, GenerationConfig(max_new=4), max_len=None, key=None,
        prompt_lengths=LENGTHS, stream=on_token,
    )  # fmt: skip
    leaves, treedef = jax.tree.flatten(model)
    buffer = np.zeros((3, request.max_len), np.int32)
    stream = on_token is not None
    return _decode.generate_program.lower(
        leaves, buffer, request.lengths, np.int32(4), request.sampling, request.key,
        np.int32(0) if stream else None, structure=treedef, batched=True, chunk=16,
        samples=None, stream=stream, differentiable=False, check_finite=True, mesh=None,
        rules=None,
    ).compile().as_text()  # fmt: skip


def test_the_program_has_a_host_callback_only_when_streaming(model):
    def callbacks(text):
        return [i for i in hlo_instructions(text) if i.opcode == "custom-call" and "callback" in i.line]

    assert callbacks(program_text(model, None)) == []
    assert len(callbacks(program_text(model, print))) >= 1


# -- generate_text(stream=...) --------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    """Byte-level BPE with few merges: an emoji or a CJK character is several tokens."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(["hello world, naïve café", "the quick brown fox"] * 10, trainer)
    return eqrope.Tokenizer(tok, eos_ids=(1,))


TEXT = "naïve 🙂 日本語 👨‍👩‍👧 café!"


def test_text_pieces_never_split_a_character(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) > len(TEXT.split())  # multi-byte characters span several tokens
    pieces = []
    stream = TextStream(tokenizer, (1,), lambda row, piece: pieces.append(piece))
    for position, token in enumerate(ids):
        stream.on_token(0, position, token)
    stream.finish(0, tokenizer.decode(ids, skip_special_tokens=True))
    assert "".join(pieces) == TEXT
    assert all("\ufffd" not in p for p in pieces)
    assert "🙂" in pieces or any(p.endswith("🙂") or p.startswith("🙂") for p in pieces)
    assert len(pieces) > 5


def test_generate_text_streams_what_it_returns(tokenizer):
    model = random_model(2, tokenizer.vocab_size, 16, 2, 1, 64, d_ff=32)
    prompts = ["hello", "naïve 🙂 world"]
    pieces = {}
    key = jax.random.key(1)
    texts = eqrope.generate_text(
        model, tokenizer, prompts, 16, temperature=1.0, key=key,
        stream=lambda row, piece: pieces.setdefault(row, []).append(piece),
    )  # fmt: skip
    assert texts == eqrope.generate_text(model, tokenizer, prompts, 16, temperature=1.0, key=key)
    assert ["".join(pieces.get(row, [])) for row in range(2)] == texts


def test_generate_text_stream_true_prints_one_text(tokenizer, capsys):
    model = random_model(2, tokenizer.vocab_size, 16, 2, 1, 64, d_ff=32)
    text = eqrope.generate_text(model, tokenizer, "hello", 10, stream=True)
    assert capsys.readouterr().out == text
    with pytest.raises(ValueError, match="stream=function"):
        eqrope.generate_text(model, tokenizer, ["a", "b"], 4, stream=True)


def test_generate_text_encodes_string_stop_sequences(tokenizer):
    model = random_model(2, tokenizer.vocab_size, 16, 2, 1, 64, d_ff=32)
    free = eqrope.generate_text(model, tokenizer, "hello", 16)
    ids = tokenizer.encode("hello")
    text = np.asarray(eqrope.generate(model, np.asarray(ids, np.int32), 16, eos_id=1)).tolist()
    new = text[len(ids) :]
    # The first pair of new tokens that is the encoding of its own text, and ends the
    # first match of that text's tokens.
    for i in range(len(new) - 1):
        pair = new[i : i + 2]
        stop = tokenizer.decode(pair)
        first = next(j for j in range(len(ids) + 1, len(text)) if text[j - 1 : j + 1] == pair)
        if tokenizer.encode(stop, add_special_tokens=False) == pair and first == len(ids) + i + 1:
            break
    else:
        pytest.fail("no pair of new tokens encodes its own text")
    cut = eqrope.generate_text(model, tokenizer, "hello", 16, stop=[stop])
    assert cut == tokenizer.decode(new[: i + 2]) and len(cut) < len(free)
    # Strings and token-id sequences may be mixed.
    assert eqrope.generate_text(model, tokenizer, "hello", 16, stop=[[tokenizer.vocab_size - 1], stop]) == cut


def test_generate_text_with_num_samples_and_a_config(tokenizer):
    model = random_model(2, tokenizer.vocab_size, 16, 2, 1, 64, d_ff=32)
    key = jax.random.key(2)
    config = eqrope.GenerationConfig(max_new=8, temperature=1.0, num_samples=3)
    texts = eqrope.generate_text(model, tokenizer, ["hello", "the fox"], config=config, key=key)
    assert [len(row) for row in texts] == [3, 3] and isinstance(texts[0][0], str)
    ids, lengths = tokenizer.encode_batch(["hello", "the fox"])
    tokens = np.asarray(eqrope.generate(model, ids, config=config, key=key, prompt_lengths=lengths, eos_id=1))
    for i in range(2):
        for j in range(3):
            new = tokens[i, j, lengths[i] :].tolist()
            new = new[: new.index(1)] if 1 in new else new
            assert texts[i][j] == tokenizer.decode(new, skip_special_tokens=True)
    one = eqrope.generate_text(model, tokenizer, "hello", config=config, key=key)
    assert len(one) == 3
