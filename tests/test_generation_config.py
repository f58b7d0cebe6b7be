"""`eqrope.GenerationConfig`: defaults, overrides, checks, and transformers' JSON files."""

import dataclasses
import json
import warnings

import jax
import numpy as np
import pytest

import eqrope
from _models import random_model
from _hf_llama import _hf_random_model, hf_lib  # noqa: F401 (hf_lib is a fixture)


VOCAB = 19
PROMPT = np.array([4, 8, 15, 16], np.int32)


@pytest.fixture(scope="module")
def model():
    return random_model(6, VOCAB, 16, 2, 1, 64, d_ff=32)


def test_the_default_config_is_generate_without_one(model):
    np.testing.assert_array_equal(
        eqrope.generate(model, PROMPT, 10), eqrope.generate(model, PROMPT, config=eqrope.GenerationConfig(max_new=10))
    )


def test_keywords_override_the_config(model):
    key = jax.random.key(1)
    config = eqrope.GenerationConfig(max_new=9, temperature=0.9, top_k=5, repetition_penalty=1.3, eos_id=[2, 3])
    settings = dict(temperature=0.9, top_k=5, repetition_penalty=1.3, eos_id=[2, 3])
    np.testing.assert_array_equal(
        eqrope.generate(model, PROMPT, config=config, key=key), eqrope.generate(model, PROMPT, 9, key=key, **settings)
    )
    # A keyword wins, None included (it turns the config's top_k off).
    np.testing.assert_array_equal(
        eqrope.generate(model, PROMPT, 4, config=config, key=key, top_k=None, min_p=0.2),
        eqrope.generate(model, PROMPT, 4, key=key, **{**settings, "top_k": None}, min_p=0.2),
    )
    assert dataclasses.replace(config, top_k=None).top_k is None


def test_fields_are_stored_checked_and_plain():
    config = eqrope.GenerationConfig(
        temperature=np.float32(0.5), top_p=1, eos_id=np.array([1, 2]), bad_ids=[3], stop=[[1, 2], "x"]
    )
    assert config.temperature == 0.5 and isinstance(config.temperature, float)
    assert config.top_p == 1.0 and config.eos_id == (1, 2) and config.bad_ids == (3,)
    assert config.stop == ((1, 2), "x")
    hash(config)  # frozen and hashable
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.top_k = 3


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(temperature=-1.0), ValueError, r"temperature must be >= 0"),
        (dict(top_p=0.0), ValueError, r"top_p must be in \(0, 1\]"),
        (dict(top_k=0), ValueError, r"top_k must be a positive int"),
        (dict(min_p=2.0), ValueError, r"min_p must be in \[0, 1\]"),
        (dict(repetition_penalty=0.0), ValueError, r"repetition_penalty must be a finite number > 0"),
        (dict(eos_id=[]), ValueError, r"eos_id is an empty sequence"),
        (dict(eos_id=[-3]), ValueError, r"eos_id\[0\] must be a token id >= 0"),
        (dict(num_samples=0), ValueError, r"num_samples must be a positive int"),
        (dict(max_new=-1), ValueError, r"max_new must be an int >= 0"),
    ],
)
def test_bad_fields_are_refused_by_name(kwargs, error, match):
    with pytest.raises(error, match=match):
        eqrope.GenerationConfig(**kwargs)


def test_generate_needs_max_new_from_somewhere(model):
    with pytest.raises(ValueError, match=r"generate needs max_new.*config with max_new"):
        eqrope.generate(model, PROMPT, config=eqrope.GenerationConfig(temperature=0.5), key=jax.random.key(0))


def write(tmp_path, fields: dict):
    (tmp_path / "generation_config.json").write_text(json.dumps(fields))
    return tmp_path


def test_from_pretrained_reads_transformers_fields(tmp_path):
    config = eqrope.GenerationConfig.from_pretrained(
        write(
            tmp_path,
            {
                "do_sample": True, "temperature": 0.6, "top_p": 0.9, "min_p": 0.05,
                "repetition_penalty": 1.1, "eos_token_id": [7, 9], "pad_token_id": 0,
                "bos_token_id": 1, "max_new_tokens": 32, "min_new_tokens": 2,
                "bad_words_ids": [[3], [4]], "num_return_sequences": 4,
                "stop_strings": "\\n\\n", "transformers_version": "4.43.0", "num_beams": 1,
            },
        )
    )  # fmt: skip
    assert config == eqrope.GenerationConfig(
        max_new=32, temperature=0.6, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
        eos_id=(7, 9), pad_id=0, stop=("\\n\\n",), min_new=2, bad_ids=(3, 4), num_samples=4,
    )  # fmt: skip
    # Greedy by default; top_k 0 and top_p 1 are off; the file itself may be named.
    greedy = eqrope.GenerationConfig.from_pretrained(
        write(tmp_path, {"temperature": 0.6, "top_k": 0, "top_p": 1.0, "eos_token_id": 2})
        / "generation_config.json"
    )
    assert (greedy.temperature, greedy.top_k, greedy.top_p, greedy.eos_id) == (0.0, None, None, 2)


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"num_beams": 4}, r"does not implement num_beams=4"),
        ({"no_repeat_ngram_size": 3, "typical_p": 0.5}, r"no_repeat_ngram_size=3, typical_p=0.5"),
        ({"bad_words_ids": [[3, 4]]}, r"multi-token words"),
        ({"top_p": 1.5, "do_sample": True}, r"top_p must be in \(0, 1\]"),
    ],
)
def test_from_pretrained_refuses_what_it_cannot_do(tmp_path, fields, match):
    with pytest.raises(ValueError, match=match):
        eqrope.GenerationConfig.from_pretrained(write(tmp_path, fields))


def test_from_pretrained_of_a_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="generation_config.json"):
        eqrope.GenerationConfig.from_pretrained(tmp_path)


@pytest.mark.hf
def test_transformers_files_read_back(tmp_path):
    transformers = pytest.importorskip("transformers")
    transformers.GenerationConfig(
        do_sample=True, temperature=0.7, top_k=20, top_p=0.8, min_p=0.1, repetition_penalty=1.2,
        eos_token_id=[1, 2], max_new_tokens=12, bad_words_ids=[[5], [6]], num_return_sequences=2,
    ).save_pretrained(tmp_path)  # fmt: skip
    config = eqrope.GenerationConfig.from_pretrained(tmp_path)
    assert config == eqrope.GenerationConfig(
        max_new=12, temperature=0.7, top_k=20, top_p=0.8, min_p=0.1, repetition_penalty=1.2,
        eos_id=(1, 2), bad_ids=(5, 6), num_samples=2,
    )  # fmt: skip


# -- lengths: max_new_tokens, max_length and transformers' default 20 (issue 44, item 5) ------

# A generation_config.json's length fields, and what transformers' `generate` makes of them
# (`_prepare_generated_length`): max_new_tokens wins; else max_length counts the prompt;
# else 20 new tokens.
LENGTH_FILES = {
    "neither": ({}, (20, None)),
    "null": ({"max_length": None, "max_new_tokens": None}, (20, None)),
    "max_length": ({"max_length": 12}, (None, 12)),
    "max_length 20": ({"max_length": 20}, (None, 20)),  # given, not the default: a total
    "both": ({"max_length": 12, "max_new_tokens": 3}, (3, None)),
}


@pytest.mark.parametrize("name", sorted(LENGTH_FILES))
def test_from_pretrained_reads_the_lengths_as_transformers(tmp_path, name):
    fields, (max_new, max_total) = LENGTH_FILES[name]
    config = eqrope.GenerationConfig.from_pretrained(write(tmp_path, fields))
    assert (config.max_new, config.max_total) == (max_new, max_total)


def test_max_total_counts_the_prompt(model):
    # Four prompt tokens and max_total=10: six new, as max_new=6.
    np.testing.assert_array_equal(
        eqrope.generate(model, PROMPT, config=eqrope.GenerationConfig(max_total=10)),
        eqrope.generate(model, PROMPT, 6),
    )
    # A ragged batch counts its longest prompt, as transformers counts the padded width.
    batch = np.array([[4, 8, 15, 16, 3], [4, 8, 0, 0, 0]], np.int32)
    np.testing.assert_array_equal(
        eqrope.generate(model, batch, max_total=9, prompt_lengths=[5, 2]),
        eqrope.generate(model, batch, 4, prompt_lengths=[5, 2]),
    )
    with pytest.raises(ValueError, match=r"max_total=4 \(transformers' max_length.*prompt of 4 tokens"):
        eqrope.generate(model, PROMPT, max_total=4)


def test_max_new_and_max_total_are_one_setting(model):
    with pytest.raises(ValueError, match="max_new=2 and max_total=9 are both set; pass one"):
        eqrope.GenerationConfig(max_new=2, max_total=9)
    with pytest.raises(ValueError, match="both set"):
        eqrope.generate(model, PROMPT, 2, max_total=9)
    # The one passed to the call replaces the config's other, either way round.
    by_total, by_new = eqrope.GenerationConfig(max_total=12), eqrope.GenerationConfig(max_new=8)
    assert eqrope.generate(model, PROMPT, 3, config=by_total).shape == (7,)
    assert eqrope.generate(model, PROMPT, config=by_new, max_total=6).shape == (6,)


def test_generate_text_runs_with_a_file_without_max_new_tokens(model, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    words = ["<unk>", "</s>", "the", "cat", "sat", "on", "a", "mat"]
    raw = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = eqrope.Tokenizer(raw)
    default = eqrope.GenerationConfig.from_pretrained(write(tmp_path, {"transformers_version": "4.45.0"}))
    assert eqrope.generate_text(model, tokenizer, "the cat", config=default) == (
        eqrope.generate_text(model, tokenizer, "the cat", 20)
    )
    total = eqrope.GenerationConfig.from_pretrained(write(tmp_path, {"max_length": 7}))
    assert eqrope.generate_text(model, tokenizer, "the cat", config=total) == (
        eqrope.generate_text(model, tokenizer, "the cat", 5)
    )


@pytest.mark.hf
def test_lengths_match_transformers_generate(tmp_path, hf_lib):
    """transformers' own `generate`, reading each file, against eqrope's, reading it with
    `GenerationConfig.from_pretrained`: the same tokens, or both refusing the prompt."""
    _, torch = hf_lib
    sizes = dict(vocab_size=23, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    theirs = _hf_random_model(hf_lib, sizes)
    theirs.save_pretrained(tmp_path, safe_serialization=True)
    ours = eqrope.from_hf(tmp_path)
    prompt = np.array([3, 1, 4, 1, 5], np.int32)
    cases = {name: fields for name, (fields, _) in LENGTH_FILES.items()}
    cases["max_length at the prompt"] = {"max_length": 5}
    for name, fields in cases.items():
        (tmp_path / "generation_config.json").write_text(json.dumps(fields))
        loaded = type(theirs).from_pretrained(tmp_path).eval()
        config = eqrope.GenerationConfig.from_pretrained(tmp_path)
        try:
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "Using the model-agnostic default max_length"
                want = loaded.generate(torch.tensor(prompt)[None], do_sample=False)[0].numpy()
        except ValueError as e:
            assert "max_length" in str(e), name
            with pytest.raises(ValueError, match="max_total=5"):
                eqrope.generate(ours, prompt, config=config)
            continue
        got = np.asarray(eqrope.generate(ours, prompt, config=config))
        assert got.tolist() == want.tolist(), name
