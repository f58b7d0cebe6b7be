import jax
import pytest


@pytest.fixture(params=["x32", "x64"])
def precision(request):
    """Run a test twice: default JAX, and with `jax_enable_x64=True`.

    The seed's diary lists bugs only x64 mode shows (mixed int32/int64 indices in
    `dynamic_update_slice`, `jnp.arange` with a traced offset). Modules opt in with
    `pytestmark = pytest.mark.usefixtures("precision")`.
    """
    with jax.enable_x64(request.param == "x64"):
        yield request.param
