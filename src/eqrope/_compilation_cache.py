"""`eqrope.use_compilation_cache`: JAX's persistent compilation cache, in one call.

A first `generate` call spends most of its time in XLA compiling the program. JAX can keep
each compiled program on disk and read it back in a later process; eqrope never turns this
on by itself (it writes to the user's disk), but one call does it, before or after other
programs have compiled. docs/kv_cache.md says what the cache keys on and where it does not
help.
"""

import os
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache

from ._checks import check_float, check_path
from ._custom_types import RealLike


def default_directory() -> Path:
    """`$XDG_CACHE_HOME/eqrope/jax`, or `~/.cache/eqrope/jax` without it."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "eqrope" / "jax"


def use_compilation_cache(
    directory: str | os.PathLike | None = None,
    *,
    min_compile_time_s: RealLike = 0.0,
) -> Path:
    """Keep every program JAX compiles from now on (eqrope's and any other) in `directory`,
    and read it back instead of compiling in later processes.

    This is JAX's persistent compilation cache (`jax_compilation_cache_dir`) with
    `jax_persistent_cache_min_compile_time_secs` set to `min_compile_time_s`: JAX's own
    default, 1 s, would skip the programs of a small model, which compile faster than
    that but still dominate its first call.

    **Arguments:**

    - `directory`: where the compiled programs go (a `str` or `os.PathLike`); created if
      missing. `~` is expanded and a relative path is resolved now, against the working
      directory of this call. `None` means `$XDG_CACHE_HOME/eqrope/jax`
      (`~/.cache/eqrope/jax`).
    - `min_compile_time_s`: programs that compile faster than this are not written (a
      Python or NumPy number of seconds).

    **Returns:** the directory JAX writes to, as an absolute, resolved `Path`.

    Programs already compiled in this process are not written; later ones are. To turn
    the cache off again, `jax.config.update("jax_compilation_cache_dir", None)`.
    """
    who = "use_compilation_cache"
    min_compile_time_s = check_float(min_compile_time_s, f"{who}: min_compile_time_s")
    if not min_compile_time_s >= 0:
        raise ValueError(
            f"{who}: min_compile_time_s must be >= 0 seconds, got {min_compile_time_s!r}."
        )
    path = check_path(
        default_directory() if directory is None else directory,
        f"{who}: directory",
    )
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(
            f"{who}: {path} is a file; pass a directory for the cache."
        )
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_time_s)
    # JAX reads the directory once, at its first compile; start again so that the setting
    # holds after programs have compiled (in a notebook, say).
    compilation_cache.reset_cache()
    return path
