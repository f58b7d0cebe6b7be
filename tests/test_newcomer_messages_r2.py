"""Issue 44, "The newcomer's path, round 2", item 7: every message a newcomer met that did
not say what to do now names the fix, and so do the three left from round 4.

One test per message, each asserting the words of the fix (what to pass or call instead).
"""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tokenizers
from _models import random_model
from _unhooked import messages_without_the_hook
from tokenizers import models, pre_tokenizers

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


# The slips whose arguments carry annotations, which the jaxtyping hook would refuse first
# under pytest: they run once without it (tests/_unhooked.py).
UNHOOKED = """
import jax, jax.numpy as jnp, numpy as np, optax
import eqrope
from _models import random_model

model = random_model(0, 23, 16, 2, 1, 32, head_bias=False)
ids = np.arange(4, dtype=np.int32)
optimizer = optax.sgd(0.1)
adapted = eqrope.lora(model, rank=2, key=jax.random.key(0))
one = jnp.arange(8, dtype=jnp.int32)
cases = {
    "eos_id": lambda: eqrope.generate(model, ids, 3, eos_id="<|im_end|>"),
    "eos_id list": lambda: eqrope.generate(model, ids, 3, eos_id=[3, "<|im_end|>"]),
    "adapter step 1-D": lambda: eqrope.make_adapter_train_step(optimizer)(
        adapted, eqrope.init_adapter_optimizer(optimizer, adapted), one, one + 1),
}
"""


@pytest.fixture(scope="module")
def unhooked():
    return messages_without_the_hook(UNHOOKED)


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


# -- generate: what to pass instead -----------------------------------------------------------


def test_generate_with_a_seed_points_to_a_key(model):
    with pytest.raises(TypeError, match=r"generate\(\) got seed=42") as info:
        eqrope.generate(model, np.arange(4, dtype=np.int32), 3, seed=42)
    assert "key=jax.random.key(42)" in str(info.value)


def test_generate_with_text_points_to_generate_text(model):
    with pytest.raises(TypeError, match="prompt must be token ids, got text") as info:
        eqrope.generate(model, "The cat sat", 5)
    assert "eqrope.generate_text(model, tokenizer, 'The cat sat', max_new)" in str(info.value)
    assert "tokenizer.encode(text)" in str(info.value)


def test_generate_with_an_eos_string_names_the_tokenizers_ids(unhooked):
    for label, name in (("eos_id", "eos_id"), ("eos_id list", "eos_id[1]")):  # the list names its entry
        message = unhooked[label]
        assert message.startswith(f"TypeError: {name} must be token ids, got the text '<|im_end|>'")
        assert "tokenizer.eos_ids" in message
        assert "tokenizer.encode('<|im_end|>', add_special_tokens=False)" in message


def test_generate_with_ragged_rows_says_pad_on_the_right_and_pass_their_lengths(model):
    rows = [[1, 2, 3], np.array([4, 5])]
    with pytest.raises(ValueError, match="ragged") as info:
        eqrope.generate(model, rows, 3)
    message = str(info.value)
    assert "Pad the rows on the right to 3 tokens" in message and "prompt_lengths=[3, 2]" in message
    # What it says runs, and gives each row's own text.
    padded = np.array([[1, 2, 3], [4, 5, 0]], np.int32)
    out = np.asarray(eqrope.generate(model, padded, 3, prompt_lengths=[3, 2]))
    alone = np.asarray(eqrope.generate(model, np.array([4, 5], np.int32), 3))
    np.testing.assert_array_equal(out[1, :5], alone)


# -- the tokenizer, the train steps ------------------------------------------------------------


def test_calling_a_tokenizer_says_use_encode():
    raw = tokenizers.Tokenizer(models.WordLevel({"<unk>": 0, "the": 1, "cat": 2}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = eqrope.Tokenizer(raw)
    with pytest.raises(TypeError, match="not callable") as info:
        tok("the cat")
    assert "tokenizer.encode(text)" in str(info.value) and "encode_batch(texts)" in str(info.value)
    assert tok.encode("the cat") == [1, 2]  # what it names gives the ids


def test_train_steps_say_what_they_are_in_their_repr(model):
    optimizer = optax.sgd(0.1)
    step = eqrope.make_train_step(optimizer)
    assert repr(step) == (
        "<eqrope.make_train_step(optimizer, loss_fn=cross_entropy): step(model, opt_state, "
        "*batch) -> (model, opt_state, loss), compiled once per batch shape and dtype>"
    )
    adapter_step = eqrope.make_adapter_train_step(optimizer, loss_fn=eqrope.cross_entropy)
    assert repr(adapter_step).startswith(
        "<eqrope.make_adapter_train_step(optimizer, loss_fn=cross_entropy): step(model, "
        "opt_state, *batch, key=None) -> (model, opt_state, loss)"
    )
    # Still the compiled step: it trains, and lowers as before.
    ids = jnp.zeros((2, 8), jnp.int32)
    state = eqrope.init_optimizer(optimizer, model)
    _, _, loss = step(model, state, ids, ids)
    compiled = step.lower(model, state, ids, ids).compile()
    np.testing.assert_allclose(compiled(model, state, ids, ids)[2], loss, rtol=1e-6)


def test_the_adapter_step_with_one_sequence_says_pass_a_batch(unhooked):
    message = unhooked["adapter step 1-D"]
    assert message.startswith("ValueError: ids must have rank 2, (batch, seq), got one sequence")
    assert "ids[None], targets[None]" in message
