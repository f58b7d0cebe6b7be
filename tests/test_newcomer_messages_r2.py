"""Issue 44, "The newcomer's path, round 2", item 7: every message a newcomer met that did
not say what to do now names the fix, and so do the three left from round 4.

One test per message, each asserting the words of the fix (what to pass or call instead).
"""

import jax
import numpy as np
import pytest
from _models import random_model

import eqrope


VOCAB, MAX_LEN = 23, 32


@pytest.fixture(scope="module")
def model():
    return random_model(0, VOCAB, 16, 2, 1, MAX_LEN, head_bias=False)


@pytest.fixture(scope="module")
def hf_dir(model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf")
    eqrope.to_hf(model, folder)
    return folder


# -- from_hf and load: which folder to pass ---------------------------------------------------


def test_from_hf_of_a_hub_id_says_eqrope_does_not_download(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="eqrope does not download") as info:
        eqrope.from_hf("HuggingFaceTB/SmolLM2-135M")
    message = str(info.value)
    assert "huggingface_hub.snapshot_download('HuggingFaceTB/SmolLM2-135M')" in message
    assert "hf download HuggingFaceTB/SmolLM2-135M" in message


def test_from_hf_of_the_safetensors_file_says_pass_its_folder(hf_dir):
    with pytest.raises(FileNotFoundError, match="pass its folder") as info:
        eqrope.from_hf(hf_dir / "model.safetensors")
    assert repr(str(hf_dir)) in str(info.value)
    assert eqrope.from_hf(hf_dir).vocab_size == VOCAB  # the folder it names loads


def test_load_of_a_hugging_face_folder_names_from_hf(hf_dir):
    with pytest.raises(ValueError, match="not written by eqrope.save") as info:
        eqrope.load(hf_dir)
    assert f"use eqrope.from_hf({str(hf_dir)!r})" in str(info.value)
    assert "from_hf_llama" not in str(info.value)  # the old alias


def test_from_hf_float64_without_x64_lists_the_dtypes(hf_dir):
    with jax.enable_x64(False), pytest.raises(ValueError, match="jax_enable_x64") as info:
        eqrope.from_hf(hf_dir, dtype=np.float64)
    message = str(info.value)
    assert "one of float32, bfloat16, float16" in message and "None for the checkpoint's" in message
    assert "Pass one of them," not in message  # "them" named nothing before
