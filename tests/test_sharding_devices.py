"""Sharded training and generation on 8 virtual CPU devices, and the multi-host launch in
two processes: `tests/multidevice_checks.py` runs once with 8 devices (the count is fixed
when JAX starts) in a subprocess, and the tests assert on its JSON report: sharded training
and generation against one device, shardings and collectives. (tests/test_sharding.py
plans the placements themselves on an abstract mesh, in this process.)
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "tests" / "multidevice_checks.py")


def cpu_env(devices: int) -> dict:
    """`devices` virtual CPU devices. LLVM's optimisations are turned down, which halves
    compile time; XLA's own passes (SPMD partitioning, collectives) are unchanged, and
    both sides of every comparison are compiled alike."""
    env = dict(os.environ)
    flags = (
        f"--xla_force_host_platform_device_count={devices} "
        "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    )
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flags).strip()
    env["JAX_PLATFORMS"] = "cpu"
    return env


def parse(stdout: str) -> dict:
    """The `RESULT {json}` line of the checks script."""
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, stdout[-2000:]
    return json.loads(lines[0].removeprefix("RESULT "))


@pytest.fixture(scope="module")
def reference_file(tmp_path_factory):
    return tmp_path_factory.mktemp("sharding") / "reference.npz"


def eight_device_report(script: str, reference_file: Path, cwd: Path) -> dict:
    """Run a checks script with `--save reference_file` on 8 virtual CPU devices in a
    subprocess, and return its report (which must say it saw 8 devices)."""
    proc = subprocess.run(
        [sys.executable, script, "--save", str(reference_file)],
        env=cpu_env(8),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = parse(proc.stdout)
    assert result["devices"] == 8
    return result


@pytest.fixture(scope="module")
def report(reference_file):
    return eight_device_report(SCRIPT, reference_file, ROOT)


@pytest.mark.multidevice
def test_sharded_train_step_equals_one_device(report):
    runs = report["training"]
    assert set(runs) == {
        f"data={d},model={m},remat={r}" for d, m in ((2, 4), (8, 1)) for r in (False, True)
    }
    for name, run in runs.items():
        for quantity in ("loss", "grads", "weights", "loss_step2", "weights_step2"):
            assert run[quantity] <= 1e-5, (name, quantity, run[quantity])
        assert run["grads_size"] > 1e-3  # the gradients compared are not all zero
        assert run["same_shardings"], name  # the step returns what it was given
        assert run["loss_spec"] == "()"
        assert not any("over ?" in key for key in run["collectives"]), run["collectives"]
    for remat in (False, True):
        tensor = runs[f"data=2,model=4,remat={remat}"]
        # Gradients are summed over the data axis; the row-parallel matmuls (wo, w_down)
        # and the vocabulary-split softmax reduce over the model axis.
        assert tensor["collectives"]["all-reduce over data"] >= 1
        assert tensor["collectives"]["all-reduce over model"] >= 4
        # Each device holds its quarter of wqkv, (blocks, d_model, 128 / 4), never all of it.
        assert tensor["local_wqkv"] and not tensor["global_wqkv"]
        # Pure data parallelism: replicated weights, only all-reduces over data.
        data = runs[f"data=8,model=1,remat={remat}"]
        assert set(data["collectives"]) == {"all-reduce over data"}


@pytest.mark.multidevice
def test_parameter_and_optimizer_shardings(report):
    # n_heads=8, n_kv_heads=4, head_dim=8, d_ff=96, vocab=256: the global size of each
    # dimension split over "model".
    qkv = (8 + 2 * 4) * 8
    assert report["param_sizes"] == {
        ".embed": {"model": 256},
        ".blocks.attn_norm.weight": {},
        ".blocks.attn.wqkv": {"model": qkv},
        ".blocks.attn.wo": {"model": 8 * 8},
        ".blocks.attn.bqkv": {"model": qkv},
        ".blocks.attn.bo": {},
        ".blocks.mlp_norm.weight": {},
        ".blocks.mlp.w_gate_up": {"model": 2 * 96},
        ".blocks.mlp.w_down": {"model": 96},
        ".blocks.mlp.b_gate_up": {"model": 2 * 96},
        ".blocks.mlp.b_down": {},
        ".final_norm.weight": {},
        ".head": {"model": 256},
        ".head_bias": {"model": 256},
    }
    assert report["param_specs"][".blocks.attn.wqkv"] == "(None, None, 'model')"
    assert report["momentum_specs"] == report["param_specs"]
    assert report["updated_specs"] == report["param_specs"]
    assert report["adam_specs"] == {
        "mu.wqkv": "(None, None, 'model')",
        "nu.head": "(None, 'model')",
        "count": "()",
    }
    other = report["other_specs"]
    assert other[".blocks.mlp.w_in"] == "(None, None, 'model')"
    assert other[".blocks.mlp.w_out"] == "(None, 'model')"
    assert other[".pos_embed"] == "()"


@pytest.mark.multidevice
def test_sharded_forward_and_cache(report):
    forward = report["forward"]
    assert forward["logits"] <= 1e-5 and forward["cache"] <= 1e-5
    assert forward["logits_x64"] <= 1e-5
    # Batch 2 on data, 4 kv heads on model; prefill returns the cache as it got it.
    assert forward["cache_sizes"] == {"data": 2, "model": 4}
    assert forward["cache_spec_out"] == forward["cache_spec_in"]
    assert forward["logits_spec"] == "('data', None, 'model')"


@pytest.mark.multidevice
def test_sharded_generation_equals_one_device_and_compiles_once(report):
    gen = report["generation"]
    assert gen["traces"] == 1  # greedy and sampled share one program
    assert gen["tokens_equal"] == [True, True]
    assert gen["lengths_equal"] == [True, True]
    assert gen["new_tokens"] > 0
    assert gen["logprobs"] <= 1e-5
    # Inside the compiled program the cache exists only as per-device blocks.
    assert gen["cache_sizes"] == {"data": 6, "model": 4}
    assert gen["local_cache"] and not gen["global_cache"]
    assert not any("over ?" in key for key in gen["collectives"])


@pytest.mark.multidevice
def test_errors_and_collectives_of_known_programs(report):
    errors = report["errors"]
    assert "'kv_heads' dimension (2)" in errors["kv_heads"] and "'model'" in errors["kv_heads"]
    for case in ("batch", "shard_batch", "generate_batch"):
        assert errors[case].startswith("ValueError") and "'batch' dimension (3)" in errors[case]
        assert "mesh axis 'data'" in errors[case]
    assert errors["explicit"].startswith("TypeError") and "AxisType.Auto" in errors["explicit"]
    assert "mesh axis 'model'" in errors["missing_axis"]
    assert errors["kv_replicated_wqkv_spec"] == "()"
    assert errors["kv_replicated_wo_spec"] == "(None, 'model')"
    assert report["hlo_parser"] == {
        "sum_rows_data": {"all-reduce over data": 1},
        "sum_columns_model": {"all-reduce over model": 1},
        "replicate_all": {"all-gather over data": 1, "all-gather over model": 1},
        "roll_rows_data": {"collective-permute over data": 1},
    }


@pytest.mark.multidevice
def test_two_processes_run_the_same_code(report, reference_file):
    """The multi-host launch, on one machine: two processes of 4 CPU devices each run the
    same train step and generation on one (data=2, model=4) mesh, and match the one-device
    results the 8-device run saved."""
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        port = probe.getsockname()[1]
    procs = [
        subprocess.Popen(
            [sys.executable, SCRIPT, "--process", str(i), "--of", "2",
             "--coordinator", f"localhost:{port}", "--reference", str(reference_file)],
            env=cpu_env(4),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    try:
        outputs = [proc.communicate(timeout=600) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    for i, (proc, (stdout, stderr)) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, stderr[-4000:]
        result = parse(stdout)["processes"]
        assert (result["process"], result["count"], result["local_devices"]) == (i, 2, 4)
        assert result["loss"] <= 1e-5 and result["weights"] <= 1e-5
        assert result["tokens_equal"]
