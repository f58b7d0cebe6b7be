"""`eqrope._upload.upload` against `jax.device_put`, which it stands for."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqrope._upload as upload_module
from eqrope._upload import upload


pytestmark = pytest.mark.usefixtures("precision")

ARRAYS = [
    np.arange(108, dtype=np.int32).reshape(1, 108),
    np.linspace(-2, 2, 6, dtype=np.float32).reshape(2, 3),
    np.array([True, False]),
    np.zeros((0,), np.int32),
    np.array(7, np.int32),
    np.arange(5, dtype=np.int64),  # narrowed to int32 by device_put without x64
    np.linspace(0, 1, 4),  # float64
    np.arange(6, dtype=np.uint8)[::2],  # not contiguous
]


def same(ours, theirs) -> None:
    assert isinstance(ours, jax.Array)
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    assert ours.weak_type == theirs.weak_type
    assert ours.sharding == theirs.sharding and ours.committed == theirs.committed
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


@pytest.mark.parametrize("x", ARRAYS, ids=lambda x: f"{x.dtype}{list(x.shape)}")
def test_upload_is_device_put(x):
    same(upload(x), jax.device_put(x))


def test_upload_takes_the_short_path_for_results():
    """The dtypes `generate` returns go the short way (a JAX that moved its internals
    would fail here, not silently run the long way)."""
    assert upload_module.batched_device_put is not None
    for x in ARRAYS[:5]:
        assert upload_module._fast(x)
    assert not upload_module._fast(jnp.zeros(3))  # a JAX array: jax.device_put


def test_upload_nested_tuples_and_default_device():
    x, y = ARRAYS[0], ARRAYS[1]
    ours = upload((x, (y, x)))
    theirs = jax.device_put((x, (y, x)))
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        same(a, b)
    device = jax.devices()[-1]
    with jax.default_device(device):
        same(upload(x), jax.device_put(x))
        assert upload(x).devices() == {device}
