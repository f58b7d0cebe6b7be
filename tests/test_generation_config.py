"""`eqrope.GenerationConfig`: defaults, overrides, checks, and transformers' JSON files."""

import dataclasses
import json

import jax
import numpy as np
import pytest

import eqrope
from _models import random_model


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
