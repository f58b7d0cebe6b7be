"""Issue 43 (round 5), B6: a prompt of `None` is named.

`generate_text(model, tok, None)` (or `["hi", None]`) reached tokenizers' bare
"TextEncodeInput must be Union[...]": `_prompts` looked for the first non-string with
`next(..., None)`, so a `None` prompt read as "none found". Every non-text prompt now gets
generate_text's own `TypeError`, with the index of the item in a list; `Tokenizer.encode`
and `encode_batch` name theirs too. Nothing compiles: the checks run first.
"""

import inspect

import pytest
import tokenizers

import eqrope
from _models import random_model


@pytest.fixture(scope="module")
def tok():
    vocab = {"<unk>": 0, "</s>": 1, "hi": 2, "there": 3}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return eqrope.Tokenizer(backend, eos_ids=(1,))


@pytest.fixture(scope="module")
def model():
    return random_model(0, 8, 16, 2, 1, 16)


WANTED = r"generate_text: prompt must be a string or a list of strings, got "


@pytest.mark.parametrize(
    "prompt, got",
    [
        (None, r"None\.$"),
        (["hi", None], r"a list holding None at prompt\[1\]\.$"),
        ((None,), r"a tuple holding None at prompt\[0\]\.$"),
        (["hi", "there", 3], r"a list holding an int at prompt\[2\]; for token ids use eqrope\.generate\.$"),
        (5, r"an int; for token ids use eqrope\.generate\.$"),
    ],
)
def test_a_prompt_that_is_not_text_is_named_with_its_index(model, tok, prompt, got):
    with pytest.raises(TypeError, match=WANTED + got):
        eqrope.generate_text(model, tok, prompt, 2)


def test_the_tokenizer_names_a_text_that_is_none(tok):
    # Unwrapped: under the tests, beartype refuses None at the annotation first.
    encode = inspect.unwrap(eqrope.Tokenizer.encode)
    encode_batch = inspect.unwrap(eqrope.Tokenizer.encode_batch)
    with pytest.raises(TypeError, match=r"encode: text must be a string, got None\."):
        encode(tok, None)
    with pytest.raises(TypeError, match=r"encode_batch: texts\[1\] must be a string, got None\."):
        encode_batch(tok, ["hi", None])
    with pytest.raises(TypeError, match=r"encode_batch takes a list of strings, got None"):
        encode_batch(tok, None)
    assert encode_batch(tok, ("hi", "there hi"))[1].tolist() == [1, 2]
