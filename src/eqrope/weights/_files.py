"""Directories written all at once: the checks before a write, and the write itself.

eqrope's checkpoints (`_checkpoint.py`) and adapters (`eqrope.adapters`) are directories
whose files must change together: `check_writable` refuses, before anything is written,
what would fail half-way; `_write_directory` writes a new directory beside the old one
and renames it into place.
"""

import os
import secrets
import shutil
from pathlib import Path


def check_writable(path: Path, who: str, *, beside: bool, files: tuple[str, ...] = ()) -> None:
    """Raise `PermissionError`, starting with `who`, unless this user may write the
    directory `path` (the nearest existing folder above it, if it does not exist yet) and
    the `files` in it that exist; with `beside`, the folder that holds `path` too (a save
    writes a new directory there and renames it into place). Run before anything is
    written, so a refused save changes nothing."""
    target = path.resolve()
    needed = []
    if target.is_dir():
        needed.append((target, "the directory itself"))
    if beside or not target.is_dir():
        folder = target.parent if beside else target
        while not folder.exists():
            folder = folder.parent
        how = "the new directory is written beside it, then renamed into place"
        needed.append((folder, how if beside else f"{path} is created inside it"))
    needed += [(target / f, "a file it replaces") for f in files if (target / f).exists()]
    for where, why in needed:
        write = os.W_OK | (os.X_OK if where.is_dir() else 0)
        if not os.access(where, write):
            kept = f"; what is at {path} is unchanged" if path.exists() else ""
            raise PermissionError(
                f"{who}: cannot write to {path}: this user may not write {where} ({why}). "
                f"Nothing was written{kept}. Pass a directory you can write, or change "
                "the permissions."
            )


def _write_directory(path: Path, files: dict[str, bytes]) -> None:
    """Make `path` a directory holding `files`, all at once: they are written into a new
    directory beside it, which replaces it by renames. An existing `path` keeps its other
    entries (hard-linked or copied over) and is put back if the swap fails."""
    target = path.resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    stem = f".{target.name}.{secrets.token_hex(4)}"
    tmp, old = target.with_name(stem + ".tmp"), target.with_name(stem + ".old")
    tmp.mkdir()
    try:
        for name, data in files.items():
            with open(tmp / name, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        if not target.is_dir():
            os.replace(tmp, target)
        else:
            shutil.copymode(target, tmp)
            for entry in target.iterdir():
                if entry.name not in files:
                    _carry(entry, tmp / entry.name)
            os.replace(target, old)
            try:
                os.replace(tmp, target)
            except BaseException:
                os.replace(old, target)
                raise
            shutil.rmtree(old, ignore_errors=True)
        fd = os.open(target.parent, os.O_RDONLY)  # make the renames durable
        os.fsync(fd)
        os.close(fd)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _carry(entry: Path, dest: Path) -> None:
    """Put `entry` at `dest` too: files and symlinks hard-linked (or copied), folders too."""
    if entry.is_dir() and not entry.is_symlink():
        shutil.copytree(entry, dest, symlinks=True, copy_function=_link_or_copy)
    else:
        _link_or_copy(entry, dest)


def _link_or_copy(src, dst) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=False)



def swapped_arguments(who: str, model, path, *, model_first: bool) -> None:
    """Raise a `TypeError` that gives the order when `who` got its directory where the
    model goes and the model where the directory goes (`save(path, model)` takes the
    directory first, `to_hf(model, path)` the model first)."""
    if isinstance(model, (str, os.PathLike)) and not isinstance(path, (str, os.PathLike)):
        order, call = ("model, path", f"{who}(model, {str(model)!r})") if model_first else (
            "path, model", f"{who}({str(model)!r}, model)")
        first, second = ("the model", "the directory") if model_first else ("the directory", "the model")
        raise TypeError(
            f"{who}({order}) takes {first} first and {second} second; it got the arguments "
            f"the other way round (a {type(path).__name__} and {str(model)!r}). Call {call}."
        )
