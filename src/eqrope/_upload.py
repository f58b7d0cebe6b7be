"""A call's small NumPy results onto the default device, in one short step.

`generate` cuts its results on the host (`generation/_result.py`) and hands them back as
JAX arrays. `jax.device_put(x)` does that, but through its general path (pytree walk,
primitive bind, per-argument sharding checks): about 0.15 ms per call on the CPU right
after a program has run, about a quarter of the seed protocol's host cost (0.55 ms then).
For one NumPy array headed, uncommitted, to the default device, `upload` calls the
transfer that `jax.device_put` ends in (`pxla.batched_device_put`) directly: the same
array (value, dtype, sharding, `committed=False`), in about 0.06 ms.

That transfer is JAX's internal API. If it moves, or for anything but a NumPy array of a
dtype JAX keeps as it is (no x64 narrowing), on a single process, `upload` is
`jax.device_put`. tests/test_upload.py checks both against `jax.device_put`. Like it, on
the CPU the result may share the NumPy array's memory: pass arrays nothing writes to later
(`finish` hands over arrays it has just made).
"""

import functools

import jax
import numpy as np


try:  # JAX's internals: the transfer behind `jax.device_put`, and the default device.
    from jax._src.core import ShapedArray
    from jax._src.interpreters.pxla import batched_device_put, get_default_device
except ImportError:  # pragma: no cover (a JAX that moved them: the public path)
    batched_device_put = None


def upload(x):
    """`jax.device_put(x)` for a NumPy array or a (nested) tuple of them: each on the
    default device, uncommitted. Anything else (a tracer, a JAX array) goes to
    `jax.device_put` as it is."""
    if isinstance(x, tuple):
        return tuple(upload(v) for v in x)
    if not _fast(x):
        return jax.device_put(x)
    device = get_default_device()
    return batched_device_put(ShapedArray(x.shape, x.dtype), _sharding(device), [x], [device], False)


def _fast(x) -> bool:
    return (
        batched_device_put is not None
        and type(x) is np.ndarray
        and x.dtype in _kept_dtypes(jax.config.jax_enable_x64)
        and jax.process_count() == 1
    )


@functools.cache
def _kept_dtypes(x64: bool) -> frozenset:
    """The dtypes that `jax.device_put` keeps as they are (x64 off narrows 64-bit ones)."""
    kinds = [np.bool_, np.int8, np.int16, np.int32, np.uint8, np.uint16, np.uint32, np.float16, np.float32]
    if x64:
        kinds += [np.int64, np.uint64, np.float64]
    return frozenset(np.dtype(k) for k in kinds)


@functools.cache
def _sharding(device) -> jax.sharding.SingleDeviceSharding:
    return jax.sharding.SingleDeviceSharding(device)
