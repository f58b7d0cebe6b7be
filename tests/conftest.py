import gc
import os
import pathlib

import jax
import jaxtyping
import pytest
from _quick import QUICK


# The suite compiles far more than it runs, and nothing here asserts a timing:
# - XLA:CPU's cheapest code generation (LLVM without its optimisation passes) compiles
#   about a quarter faster;
# - XLA:CPU's older loop emitters instead of its MLIR fusion emitters compile a seed-sized
#   `generate` program in less than half the CPU time (3.3 s against 7.4 s for three
#   programs, measured 2026-12-03).
# Read when JAX starts its CPU backend, after this file is imported; the scripts the tests
# run in subprocesses inherit them.
os.environ["XLA_FLAGS"] = " ".join(
    filter(
        None,
        (
            os.environ.get("XLA_FLAGS"),
            "--xla_backend_optimization_level=0",
            "--xla_cpu_use_fusion_emitters=false",
        ),
    )
)




def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in QUICK and item.path.parent.name == "tests":
            item.add_marker(pytest.mark.quick)


@pytest.fixture(params=["x32", "x64"])
def precision(request):
    """Run a test twice: default JAX, and with `jax_enable_x64=True`.

    The seed's diary lists bugs only x64 mode shows (mixed int32/int64 indices in
    `dynamic_update_slice`, `jnp.arange` with a traced offset). Modules opt in with
    `pytestmark = pytest.mark.usefixtures("precision")`.
    """
    with jax.enable_x64(request.param == "x64"):
        yield request.param


@pytest.fixture(scope="module")
def offline(tmp_path_factory):
    """For lm-eval's tasks: no network, a private datasets cache, and the repository as
    the working directory (the tasks of tests/data/lm_eval name their data files relative
    to it)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_DATASETS_OFFLINE", "1")
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("datasets")))
        patch.chdir(pathlib.Path(__file__).resolve().parents[1])
        yield


# Linux allows a process 65,530 memory mappings (vm.max_map_count), and each program XLA
# compiles for the CPU holds hundreds of them (a small `generate` program about 570) for
# as long as JAX caches it. A test worker that runs half the suite compiles thousands of
# programs and would pass the limit, and XLA then crashes the worker (a segfault or an
# abort inside a compile). Past a threshold, JAX's caches are cleared between modules;
# nothing in a module is cleared under it, so compile counts inside a module still hold.
MAPPINGS_BEFORE_CLEARING = 25_000


def _mappings() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return 0


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    yield
    if _mappings() > MAPPINGS_BEFORE_CLEARING:
        jax.clear_caches()
        gc.collect()


@pytest.fixture
def unchecked():
    """Turn off the suite's jaxtyping hook (which refuses a np.float32 for a `float` field
    itself), to test eqrope's own checks as users run them."""
    jaxtyping.config.update("jaxtyping_disable", True)
    yield
    jaxtyping.config.update("jaxtyping_disable", False)
