"""Issue 43 (round 5), B2 and B5: `eqrope.use_compilation_cache`'s arguments.

- B2: `"~/x"` is `$HOME/x` (it was a folder named `~` under the working directory), and a
  relative path is resolved at the call (JAX resolved it at the first compile, so after an
  `os.chdir` the programs went elsewhere and the directory returned stayed empty).
- B5: a NumPy number of seconds is a number; a `directory` that is not a path is refused
  by name.

Each test counts the files JAX writes, then puts JAX's cache settings back.
"""

import inspect
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache

import eqrope


_SETTINGS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")


@pytest.fixture(autouse=True)
def restore_jax_cache():
    """JAX's cache settings as they were before the test (no cache, for the rest)."""
    previous = {name: getattr(jax.config, name) for name in _SETTINGS}
    yield
    for name, value in previous.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()


def _files(directory: Path) -> int:
    return sum(p.is_file() for p in directory.rglob("*")) if directory.exists() else 0


def _compile_something_new(scale: float) -> None:
    """A program this process has not compiled yet (a constant of its own)."""
    jax.jit(lambda x: x * scale + 1)(jnp.arange(5.0)).block_until_ready()


def test_tilde_is_the_home_directory(tmp_path, monkeypatch):
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(), work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    returned = eqrope.use_compilation_cache("~/jaxcache")
    assert returned == (home / "jaxcache").resolve() and returned.is_dir()
    assert jax.config.jax_compilation_cache_dir == str(returned)
    _compile_something_new(3.0)
    assert _files(home / "jaxcache") > 0
    assert not (work / "~").exists()


def test_a_relative_path_is_resolved_at_the_call(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    returned = eqrope.use_compilation_cache("relcache")
    assert returned.is_absolute() and returned == (tmp_path / "relcache").resolve()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    _compile_something_new(5.0)
    assert _files(tmp_path / "relcache") > 0
    assert not (tmp_path / "elsewhere" / "relcache").exists()


@pytest.mark.parametrize("seconds", [np.float32(0.5), np.float64(0.25), np.int64(1), np.array(0.75), 2])
def test_numpy_numbers_of_seconds_are_numbers(tmp_path, seconds):
    eqrope.use_compilation_cache(tmp_path, min_compile_time_s=seconds)
    assert jax.config.jax_persistent_cache_min_compile_time_secs == float(seconds)


@pytest.mark.parametrize(
    "seconds, error",
    [(True, TypeError), ("1", TypeError), (float("nan"), ValueError), (-1, ValueError)],
)
def test_what_is_not_a_number_of_seconds_is_refused_by_name(tmp_path, seconds, error):
    # The unwrapped function: under the tests, beartype refuses a string at the annotation.
    use = inspect.unwrap(eqrope.use_compilation_cache)
    with pytest.raises(error, match="use_compilation_cache: min_compile_time_s"):
        use(tmp_path, min_compile_time_s=seconds)


@pytest.mark.parametrize("directory", [5, b"/tmp/x", 1.5])
def test_a_directory_that_is_not_a_path_is_refused_by_name(directory):
    # Under the tests the annotation's check runs first; both name `directory`.
    with pytest.raises(TypeError, match="directory"):
        eqrope.use_compilation_cache(directory)
    use = inspect.unwrap(eqrope.use_compilation_cache)
    message = r"use_compilation_cache: directory must be a path \(a str or os.PathLike"
    with pytest.raises(TypeError, match=message):
        use(directory)


def test_an_empty_directory_name_is_refused():
    with pytest.raises(ValueError, match="directory is an empty string"):
        eqrope.use_compilation_cache("")
