"""Loading holds a checkpoint about once: `eqrope.from_hf` and `eqrope.load`, both layouts.

Each case runs in a fresh Python process (bench/load.py's child, the measurement of its
`memory` section), so that nothing the test session holds, or has freed into the
allocator, hides or inflates the growth. The child imports JAX and eqrope, loads a tiny
checkpoint of the same kind (JAX's CPU client and first buffers are then allocated),
lowers its peak resident set to the current one (`5` to `/proc/self/clear_refs`; where
that is refused the peak is the process's whole life, which only makes the check
stricter), and reads `VmRSS` before and `VmHWM` after loading a bfloat16 checkpoint of
39 MiB: large enough that the interpreter's noise (a few MiB) is small beside it.

Measured on a 2-core machine (load average 10): 1.05x the file's bytes for `from_hf`
(a 1 MiB staging buffer and the files' buffers), 1.01x for `eqrope.load`, in either
layout; the loader this replaced read every tensor, then
converted, fused and stacked copies of them and handed JAX another copy: 3.5x and 4.3x
(`from_hf`, stacked and unstacked), 2.4x and 3.0x (`load`)."""

import pytest
from _bench import load_child
from _models import random_model

import eqrope


# Llama-shaped, untied, bfloat16: 20.4M parameters, 39 MiB. The vocabulary's two tables
# (the head is transposed on the way in) and the fused, stacked projections are the cases.
SIZES = dict(vocab_size=8192, d_model=512, n_heads=8, n_blocks=4, max_len=256, d_ff=1536)
OPTIONS = dict(n_kv_heads=2, head_bias=False, dtype="bfloat16")
TINY = dict(vocab_size=64, d_model=32, n_heads=2, n_blocks=2, max_len=16, d_ff=64)
LIMIT = 1.3  # peak growth / file bytes


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """`{kind: (checkpoint, tiny checkpoint)}`: the same model written by `to_hf` and `save`."""
    root = tmp_path_factory.mktemp("load_memory")
    out = {"from_hf": [], "load": []}
    for name, sizes in (("model", SIZES), ("tiny", TINY)):
        model = random_model(0, **sizes, **OPTIONS)
        out["from_hf"].append(eqrope.to_hf(model, root / f"hf_{name}"))
        out["load"].append(eqrope.save(root / f"eqrope_{name}", model))
    return out


@pytest.mark.parametrize("layout", ["stacked", "unstacked"])
@pytest.mark.parametrize("kind", ["from_hf", "load"])
def test_loading_holds_the_checkpoint_about_once(checkpoints, kind, layout):
    path, tiny = checkpoints[kind]
    file_nbytes = (path / "model.safetensors").stat().st_size
    # bench/load.py's child: a fresh process, the tiny checkpoint loaded first, the peak reset.
    record = load_child({"memory": [[kind, layout, str(path), str(tiny)]], "time": None}, timeout=120)["memory"][0]
    assert record["layout"] == layout
    ratio = record["growth_nbytes"] / file_nbytes
    assert ratio <= LIMIT, (
        f"eqrope.{kind}(layout={layout!r}) raised the peak RSS by "
        f"{record['growth_nbytes'] / 2**20:.1f} MiB for a {file_nbytes / 2**20:.1f} MiB "
        f"checkpoint ({ratio:.2f}x, limit {LIMIT}x; peak reset: {record['peak_reset']})"
    )
