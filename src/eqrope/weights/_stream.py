"""Safetensors files read tensor by tensor, straight into the arrays the model keeps.

Loading holds the model once, plus a few MiB: each array of the model is allocated once
(`empty`), filled from the files chunk by chunk (`Reader`), and handed to JAX
(`to_device`), which on the CPU keeps that very buffer.

- **Headers.** `read_header` lets safetensors check a file (a damaged one raises its own
  error) and reads where each tensor's bytes are (`Tensor`), without reading any.
- **Reads.** `Reader` reads with `readinto`, not through safetensors' memory map: every
  page of a mapped file that has been read counts in the process's resident set until
  the map is closed, so reading a whole file through one map costs its size again
  (measured: +258 MiB for a 257 MiB file). A tensor that is stored as the model holds it
  is read straight into its array; one that is transposed, reordered or converted goes
  through a 1 MiB buffer that stays in the cache.
- **JAX.** `jax.device_put` of a NumPy array on the CPU aliases it when it is 64-byte
  aligned and copies it otherwise (`jnp.asarray` always copies, measured with jax
  0.10); NumPy aligns large arrays to 16 bytes only, so `empty` maps pages itself.
"""

import dataclasses
import json
import math
import mmap
import struct
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import safetensors


# Safetensors' dtype codes, as NumPy (and ml_dtypes, which JAX uses) name them.
_DTYPES = {
    "BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16,
    "U32": np.uint32, "I32": np.int32, "U64": np.uint64, "I64": np.int64,
    "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F32": np.float32, "F64": np.float64,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
}  # fmt: skip
_MAP_FLAGS = (
    mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    if hasattr(mmap, "MAP_ANONYMOUS")
    else None
)
_CHUNK = 2**20  # bytes read at a time (1 MiB: a transposed chunk stays in the cache)


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One tensor of a safetensors file: what it holds and where its bytes are
    (`start`: the offset of its first byte in `file`)."""

    file: Path
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def rows(self) -> int:
        """The length of the first axis (1 for a scalar)."""
        return self.shape[0] if self.shape else 1

    @property
    def row_nbytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize


def read_header(file: Path) -> tuple[dict[str, str], dict[str, Tensor]]:
    """The metadata of the safetensors `file` and its tensors by name, no data read.

    safetensors opens the file first, so a damaged header, or data shorter or longer
    than the header says, raises safetensors' own error; a dtype NumPy cannot hold raises
    `TypeError`.
    """
    with safetensors.safe_open(str(file), framework="numpy") as f:
        metadata, names = f.metadata() or {}, list(f.keys())
    with open(file, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    tensors = {}
    for name in names:  # in safetensors' order
        entry = header[name]
        if entry["dtype"] not in _DTYPES:
            raise TypeError(f"tensor {name!r} has dtype {entry['dtype']}, which NumPy cannot hold")
        dtype, shape = np.dtype(_DTYPES[entry["dtype"]]), tuple(entry["shape"])
        tensors[name] = Tensor(file, name, dtype, shape, 8 + size + entry["data_offsets"][0])
    return metadata, tensors


def empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """A zeroed C-contiguous array in memory of its own, mapped from the system (and
    faulted in at once where Linux allows): page-aligned, so that `to_device` keeps it on
    the CPU, and in pages of 4 KiB. NumPy asks for huge pages above 4 MiB, which the
    system may compact memory for, page by page: measured 2.4x the load time of a
    stacked Qwen2.5-0.5B (4.3 s against 1.8 s), as `load_file` takes 1.9 s."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if _MAP_FLAGS is None:  # Windows: NumPy's memory, 64-byte aligned by hand
        raw = np.zeros(nbytes + 64, np.uint8)
        memory = raw[-raw.ctypes.data % 64 :]
    else:
        memory = mmap.mmap(-1, max(nbytes, 1), flags=_MAP_FLAGS)
    return np.frombuffer(memory, np.uint8, nbytes).view(dtype).reshape(shape)


def to_device(a: np.ndarray) -> jax.Array:
    """`a` as a JAX array on the default device: the same memory on the CPU when `a`
    comes from `empty` (then `a` must not be written again), a copy elsewhere."""
    return jax.device_put(a)


class Reader:
    """Reads tensors out of safetensors files into arrays; a context manager that keeps
    each file open until it exits."""

    def __init__(self):
        self._files = {}
        self._staging = np.empty(0, np.uint8)

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def read_into(self, t: Tensor, out: np.ndarray, offset: int = 0, hasher=None) -> None:
        """The `out.nbytes` bytes of `t` from byte `offset` on, into the C-contiguous
        `out`, in chunks; each chunk also goes to `hasher.update` if given."""
        if not out.flags.c_contiguous:
            raise ValueError("read_into needs a C-contiguous array")
        dest = out.reshape(-1).view(np.uint8)
        if offset < 0 or offset + dest.size > t.nbytes:
            raise ValueError(f"bytes {offset}..{offset + dest.size} lie outside tensor {t.name!r}")
        f = self._file(t.file)
        f.seek(t.start + offset)
        for begin in range(0, dest.size, _CHUNK):
            chunk = dest[begin : begin + _CHUNK]
            if f.readinto(memoryview(chunk)) != chunk.size:
                raise EOFError(f"{t.file} ended inside tensor {t.name!r}")
            if hasher is not None:
                hasher.update(memoryview(chunk))

    def rows(self, t: Tensor, lo: int, hi: int) -> np.ndarray:
        """Rows `lo..hi` of `t` in the staging buffer, valid until the next read."""
        row_nbytes = t.row_nbytes
        need = (hi - lo) * row_nbytes
        if self._staging.size < need:
            self._staging = empty((need,), np.uint8)
        out = self._staging[:need].view(t.dtype).reshape((hi - lo, *t.shape[1:]))
        self.read_into(t, out, lo * row_nbytes)
        return out

    def copy(self, t: Tensor, out: np.ndarray, *, transpose: bool = False, row_order=None) -> None:
        """`out[...] = t`, converted to `out.dtype`: with `row_order`, the rows of `t` in
        that order (`t[row_order]`); with `transpose`, the 2-D `t` transposed (`t.T`,
        after the reordering). `out` may be a strided view; `t` is read in chunks of rows.
        """
        plain = not transpose and row_order is None and out.dtype == t.dtype
        if plain and out.flags.c_contiguous:
            self.read_into(t, out)
            return
        for r0, r1 in _chunks(t):
            if row_order is None:
                block = self.rows(t, r0, r1)
            else:  # the rows these come from, read as one span (a few rows more at most)
                wanted = row_order[r0:r1]
                lo = int(wanted.min())
                block = self.rows(t, lo, int(wanted.max()) + 1)[wanted - lo]
            if transpose:
                out[:, r0:r1] = block.T
            else:
                out[r0:r1] = block

    def equal(self, a: Tensor, b: Tensor) -> bool:
        """`np.array_equal` of the two tensors' values, read chunk by chunk."""
        if a.shape != b.shape:
            return False
        for r0, r1 in _chunks(a):
            first = self.rows(a, r0, r1).copy()
            if not np.array_equal(first, self.rows(b, r0, r1)):
                return False
        return True

    def _file(self, file: Path):
        if file not in self._files:
            self._files[file] = open(file, "rb")
        return self._files[file]


def _chunks(t: Tensor):
    """`(r0, r1)`: the rows of `t` in runs of about `_CHUNK` bytes (at least one row)."""
    step = max(1, _CHUNK // max(1, t.row_nbytes))
    return ((r0, min(t.rows, r0 + step)) for r0 in range(0, t.rows, step))
