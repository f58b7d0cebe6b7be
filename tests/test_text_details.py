"""`generate_text(..., return_details=True)` (issue 44, item 2): each row's text with its new
token ids, their count and why it ended, checked against `eqrope.generate`'s own tokens
and lengths and the tokenizer's `decode`."""

import numpy as np
import pytest

import eqrope

from _serve import write_checkpoint


PROMPT = "One, two"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = write_checkpoint(tmp_path_factory.mktemp("details") / "ckpt")
    tok = eqrope.Tokenizer.from_pretrained(folder)
    model = eqrope.from_hf(folder)
    ids = np.asarray(tok.encode(PROMPT), np.int32)
    out = eqrope.generate(model, ids, 20, eos_id=list(tok.eos_ids), return_logprobs=True)
    new = np.asarray(out.tokens)[len(ids) : int(out.lengths)].tolist()
    assert len(new) == 20 and tok.eos_ids[0] not in new  # this model runs to max_new
    return tok, model, ids, new


def _agrees(detail, tok, new_ids):
    assert isinstance(detail, eqrope.TextGeneration)
    assert list(detail.token_ids) == new_ids
    assert detail.num_new_tokens == len(new_ids)
    kept = new_ids[:-1] if detail.finish_reason == "eos" else new_ids
    assert detail.text == tok.decode(kept, skip_special_tokens=True)


def test_length(setup):
    tok, model, ids, new = setup
    detail = eqrope.generate_text(model, tok, PROMPT, 12, return_details=True)
    assert detail.finish_reason == "length"
    _agrees(detail, tok, new[:12])
    assert detail.text == eqrope.generate_text(model, tok, PROMPT, 12)


def test_a_full_cache_is_length(setup):
    tok, model, ids, new = setup
    with pytest.warns(eqrope.TruncationWarning):
        detail = eqrope.generate_text(model, tok, PROMPT, 50, max_len=len(ids) + 5, return_details=True)
    assert detail.finish_reason == "length"
    _agrees(detail, tok, new[:5])


def test_eos(setup):
    tok, model, ids, new = setup
    eos = new[6]
    first = new.index(eos)
    config = eqrope.GenerationConfig(eos_id=eos, max_new=20)
    detail = eqrope.generate_text(model, tok, PROMPT, config=config, return_details=True)
    assert detail.finish_reason == "eos"
    _agrees(detail, tok, new[: first + 1])  # the EOS is a token, not text


def test_stop_strings_and_sequences(setup):
    tok, model, ids, new = setup
    sequence = new[8:10]
    end = next(i for i in range(2, 21) if new[i - 2 : i] == sequence)
    detail = eqrope.generate_text(model, tok, PROMPT, 20, stop=[sequence], return_details=True)
    assert detail.finish_reason == "stop"
    _agrees(detail, tok, new[:end])
    # A stop completed by the last token max_new allows is a stop, as OpenAI reports it.
    exact = eqrope.generate_text(model, tok, PROMPT, end, stop=[sequence], return_details=True)
    assert exact.finish_reason == "stop" and list(exact.token_ids) == new[:end]
    # A stop string, written across tokens.
    spelled = b"".join(tok.token_bytes()[t] for t in new[:end])
    string = next(
        spelled[i : i + 2].decode() for i in range(len(spelled) - 2, 0, -1) if spelled[i : i + 2].isascii()
    )
    detail = eqrope.generate_text(model, tok, PROMPT, 20, stop=[string], return_details=True)
    assert detail.finish_reason == "stop" and string in detail.text


def test_min_new_holds_back_a_stop_reason(setup):
    tok, model, ids, new = setup
    sequence = [new[3]]
    detail = eqrope.generate_text(model, tok, PROMPT, 10, stop=[sequence], min_new=8, return_details=True)
    later = [i + 1 for i in range(8, 10) if new[i] == new[3]]
    assert detail.finish_reason == ("stop" if later else "length")
    _agrees(detail, tok, new[: later[0] if later else 10])


def test_the_shape_follows_the_texts(setup):
    tok, model, ids, new = setup
    texts = eqrope.generate_text(model, tok, [PROMPT, "The cat"], 6, num_samples=2)
    details = eqrope.generate_text(model, tok, [PROMPT, "The cat"], 6, num_samples=2, return_details=True)
    assert [[d.text for d in row] for row in details] == texts
    assert [[d.num_new_tokens for d in row] for row in details] == [[6, 6], [6, 6]]
    with pytest.raises(TypeError, match="return_details must be True or False"):
        eqrope.generate_text(model, tok, PROMPT, 6, return_details="yes")
