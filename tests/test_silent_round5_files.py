"""Issue 43 (round 5): the files eqrope reads and writes.

- B3: `save_pretrained(d, max_shard_size=...)` then `save_pretrained(d)` leaves a stale
  `model.safetensors.index.json` beside a complete `model.safetensors`. transformers reads
  `model.safetensors` first; so does `from_hf` (it raised about a deleted shard), with a
  warning that names both files.
- "Every path argument is expanded and resolved at the call": `"~/x"` is `$HOME/x` in every
  function that takes a path (it was a folder named `~` under the working directory), and
  what is not a path is refused by name.

No torch: the checkpoints are written by `eqrope.to_hf` and by hand.
"""

import inspect
import json

import jax
import numpy as np
import pytest
import tokenizers

import eqrope
from _models import random_model


def _model():
    return random_model(0, 16, 16, 2, 2, 12, head_bias=False)


def _equal(a, b) -> bool:
    """The same arrays, bit for bit, whichever layout each model is held in."""
    a, b = (m.stacked() if isinstance(m, eqrope.RotaryDecoder) else m for m in (a, b))
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(leaves_a) == len(leaves_b) and all(
        np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(leaves_a, leaves_b)
    )


# -- B3: a stale index beside model.safetensors -------------------------------------------


def _stale_index(directory, shards: int, *, write_shards: bool) -> None:
    """The index a sharded save leaves: every tensor of model.safetensors, in `shards`
    files (written only with `write_shards`)."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(directory / "model.safetensors"))
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        shard = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        weight_map.update(dict.fromkeys(part, shard))
        if write_shards:
            save_file({n: np.zeros_like(a) for n, a in part.items()}, str(directory / shard))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("shards_present", [False, True], ids=["shards-deleted", "shards-present"])
def test_model_safetensors_is_read_beside_an_index_as_transformers_reads_it(tmp_path, shards_present):
    model = _model()
    eqrope.to_hf(model, tmp_path)
    _stale_index(tmp_path, 3, write_shards=shards_present)
    with pytest.warns(UserWarning) as caught:
        loaded = eqrope.from_hf(tmp_path)
    assert _equal(loaded, model)  # model.safetensors, not the index's (zero) shards
    message = str(caught[0].message)
    assert "model.safetensors.index.json" in message and "reading model.safetensors" in message
    assert "Delete the stale one" in message


def test_an_index_alone_is_still_read(tmp_path):
    model = _model()
    eqrope.to_hf(model, tmp_path)
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for s in range(2):
        shard = f"model-{s + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in names[s::2]}, str(tmp_path / shard))
        weight_map.update(dict.fromkeys(names[s::2], shard))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert _equal(eqrope.from_hf(tmp_path), model)


# -- paths: `~` and what is not a path ----------------------------------------------------


@pytest.fixture
def home(tmp_path, monkeypatch):
    """`$HOME` in tmp_path, and another working directory."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(), work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    yield home
    assert not (work / "~").exists()  # nothing went into a folder named `~`


def test_save_and_load_expand_the_tilde(home):
    model = _model()
    assert eqrope.save("~/ckpt", model) == (home / "ckpt").resolve()
    assert (home / "ckpt" / "model.safetensors").is_file()
    assert _equal(eqrope.load("~/ckpt"), model)


def test_to_hf_and_from_hf_expand_the_tilde(home):
    model = _model()
    assert eqrope.to_hf(model, "~/hf") == (home / "hf").resolve()
    assert (home / "hf" / "config.json").is_file()
    assert _equal(eqrope.from_hf("~/hf"), model)


def test_adapters_expand_the_tilde(home):
    base = _model()
    adapted = eqrope.lora(base, rank=2, key=jax.random.key(0))
    assert eqrope.save_adapter("~/adapter", adapted) == (home / "adapter").resolve()
    assert _equal(eqrope.load_adapter(base, "~/adapter"), adapted)
    assert eqrope.to_peft(adapted, "~/peft") == (home / "peft").resolve()
    assert (home / "peft" / "adapter_config.json").is_file()
    assert _equal(eqrope.from_peft(base, "~/peft"), adapted)


def test_tokenizer_and_generation_config_expand_the_tilde(home):
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    (home / "ckpt").mkdir()
    backend.save(str(home / "ckpt" / "tokenizer.json"))
    (home / "ckpt" / "generation_config.json").write_text(json.dumps({"max_new_tokens": 7}))
    assert eqrope.Tokenizer.from_pretrained("~/ckpt").encode("a a") == [1, 1]
    assert eqrope.GenerationConfig.from_pretrained("~/ckpt").max_new == 7


def test_a_hub_id_is_named_as_given(home):
    with pytest.raises(FileNotFoundError, match=r"snapshot_download\('org/model'\)"):
        eqrope.Tokenizer.from_pretrained("org/model")


CALLS = {
    "eqrope.save": lambda f, path: f(path, _model()),
    "eqrope.load": lambda f, path: f(path),
    "to_hf": lambda f, path: f(_model(), path),
    "from_hf": lambda f, path: f(path),
    "eqrope.load_adapter": lambda f, path: f(_model(), path),
    "eqrope.from_peft": lambda f, path: f(_model(), path),
    "Tokenizer.from_pretrained": lambda f, path: f(eqrope.Tokenizer, path),
    "GenerationConfig.from_pretrained": lambda f, path: f(eqrope.GenerationConfig, path),
}
FUNCTIONS = {
    "eqrope.save": eqrope.save,
    "eqrope.load": eqrope.load,
    "to_hf": eqrope.to_hf,
    "from_hf": eqrope.from_hf,
    "eqrope.load_adapter": eqrope.load_adapter,
    "eqrope.from_peft": eqrope.from_peft,
    "Tokenizer.from_pretrained": eqrope.Tokenizer.from_pretrained.__func__,
    "GenerationConfig.from_pretrained": eqrope.GenerationConfig.from_pretrained.__func__,
}


@pytest.mark.parametrize("who", sorted(CALLS))
def test_a_path_that_is_not_a_path_is_refused_by_name(who):
    # Unwrapped: under the tests, beartype refuses an int at the annotation first.
    function = inspect.unwrap(FUNCTIONS[who])
    with pytest.raises(TypeError, match=rf"{who}: path must be a path \(a str or os.PathLike"):
        CALLS[who](function, 5)
