"""A model as `from_hf` returns it generates without copying its weights in the call.

Each dtype runs in a fresh Python process (bench/load.py's child, its `generate` section):
it loads the checkpoint with `eqrope.from_hf` (the default: the decoding layout, unstacked
for float32, stacked for bfloat16 on the CPU), runs one `generate`
call, which compiles, then three more, each after lowering the peak resident set to the
current one (`/proc/self/clear_refs`); the largest peak growth of those calls must stay
under a tenth of the weights' bytes. A fresh process, so that nothing the test session
holds, or has freed into the allocator, hides a per-call copy.

The model is Llama-shaped with a large vocabulary (100 MiB of float32 weights, 50 MiB in
bfloat16), so that the weights dominate the interpreter's noise (a few MiB), and so that
the largest single conversion a bfloat16 step makes on the CPU (one sixteenth of the head,
or one block's fused gate and up projection, in float32: about 4% of the weights) fits.

The child waits 0.2 s before each reset: a call's scratch is freed after its results
are ready, and a reset before that would hide the next call's growth. Measured on a
2-core machine (load average 4-7): 0.001-0.002x (float32) and 0.01-0.05x (bfloat16; a
sixteenth of the head in float32 is 4% of the weights). Each test takes about 5 s. On
main before this change, `from_hf` returned every model stacked: a float32 model's blocks
were sliced into a per-call copy (0.39x the weights at this shape), and a bfloat16 head
was converted to float32 whole (0.64x); both fail here.
"""

import jax
import pytest
from _bench import load_child
from _models import random_model

import eqrope


SIZES = dict(vocab_size=32768, d_model=256, n_heads=4, n_blocks=12, max_len=64, d_ff=768)
OPTIONS = dict(n_kv_heads=2, head_bias=False)
LIMIT = 0.1  # peak growth of a later call / weights' bytes


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("weight_copies")
    model = random_model(0, **SIZES, **OPTIONS)  # float32; the bfloat16 one is the same draws, cast
    out = {"float32": eqrope.to_hf(model, root / "float32")}
    del model
    out["bfloat16"] = eqrope.to_hf(random_model(0, **SIZES, **OPTIONS, dtype="bfloat16"), root / "bfloat16")
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_later_generate_call_holds_no_copy_of_the_weights(checkpoints, dtype):
    record = load_child({"memory": [], "time": None, "generate": [[str(checkpoints[dtype]), None]]})["generate"][0]
    assert record["ratio"] < LIMIT, (
        f"a later eqrope.generate call on a {dtype} model from from_hf raised the peak RSS by "
        f"{record['growth_nbytes'] / 2**20:.1f} MiB for {record['weights_nbytes'] / 2**20:.1f} MiB "
        f"of weights ({record['ratio']:.2f}x, limit {LIMIT}x; calls: {record['calls']})"
    )
    # The decoding layout: stacked for bfloat16 on the CPU (read in place too), else unstacked.
    low_on_cpu = dtype == "bfloat16" and jax.default_backend() == "cpu"
    assert record["layout"] == ("stacked" if low_on_cpu else "unstacked") and record["dtype"] == dtype


def test_the_default_layout_follows_the_dtype_and_an_explicit_one_is_kept(tmp_path):
    """`layout=None` is the decoding layout: unstacked, but stacked for bfloat16 and
    float16 on the CPU (whose steps convert each weight inside the step in either
    layout, and whose stacked prefill compiles in about half the time)."""
    from eqrope.model._layouts import decoding_layout

    assert [decoding_layout(d, "cpu") for d in ("float32", "bfloat16", "float16")] == ["unstacked", "stacked", "stacked"]
    assert [decoding_layout(d, "gpu") for d in ("float32", "bfloat16")] == ["unstacked", "unstacked"]
    tiny = dict(vocab_size=32, d_model=16, n_heads=2, n_blocks=2, max_len=8, d_ff=32, head_bias=False)
    for dtype in ("float32", "bfloat16"):
        folder = eqrope.save(tmp_path / dtype, random_model(0, **tiny, dtype=dtype))
        loaded = {layout: eqrope.load(folder, layout=layout).layout for layout in (None, "stacked", "unstacked")}
        assert loaded == {None: decoding_layout(dtype), "stacked": "stacked", "unstacked": "unstacked"}
