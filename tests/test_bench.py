"""bench/kv_cache.py in its tiny mode: every key present, every figure consistent.

Timings are never asserted; the checks compare each derived figure with the raw ones it
comes from, and the byte counts with a hand computation from the model's sizes.
"""

import json
import math
import os
import pathlib
import statistics
import subprocess
import sys

import pytest
from _bench import BENCH, ROOT, SMOKE_ENV, load


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    # .ci/run has just run this very command (its newcomer's step, [dev] alone, the same
    # flags) and says where: check that run rather than run the tiny bench twice.
    given = os.environ.get("EQROPE_KV_CACHE_TINY")
    if given:
        out = pathlib.Path(given)
        data = json.loads((out / "kv_cache_cpu.json").read_text())
        return out, data, (out / "stdout.txt").read_text()
    out = tmp_path_factory.mktemp("kv_cache")
    proc = subprocess.run(
        [sys.executable, str(BENCH / "kv_cache.py"), "--tiny", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=SMOKE_ENV,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads((out / "kv_cache_cpu.json").read_text())
    return out, data, proc.stdout


def close(a, b):
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)


def check_timing(t, repeats=None):
    assert set(t) >= {"first_s", "first_compile", "first_compiles", "median_s", "min_s", "max_s",
                      "times_s"}
    if repeats is not None:
        assert len(t["times_s"]) == repeats == t["repeats"]
    assert close(t["median_s"], statistics.median(t["times_s"]))
    assert t["min_s"] == min(t["times_s"]) and t["max_s"] == max(t["times_s"])
    assert 0 < t["min_s"] <= t["median_s"] <= t["max_s"]
    assert set(t["first_compile"]) == {"trace_s", "lower_s", "compile_s"}


def test_seed_keys_and_consistency(run):
    _, data, _ = run
    # The seed's reader: d['cache']['median_s'], d['no_cache']['median_s'], d['speedup_median'].
    for path in ("cache", "no_cache"):
        check_timing(data[path], repeats=1)
    assert close(data["speedup_median"], data["no_cache"]["median_s"] / data["cache"]["median_s"])
    seed = data["seed"]
    assert seed["identical_tokens"] is True
    assert seed["params"] == 139_777  # the seed page's count for (65, 64, 4, 2, 256)
    assert seed["prompt"] == list(range(8))
    assert seed["tokens"][:8] == list(range(8))
    assert len(seed["tokens"]) == 8 + seed["max_new"]
    # Texts of 8 .. 8 + max_new - 1 tokens, padded to powers of two of at least 16.
    assert seed["uncached_path"]["padded_widths"] == [16]
    assert "every token" in seed["uncached_path"]["how"]


def test_growth(run):
    _, data, _ = run
    g = data["growth"]
    assert g["n"] == data["sizes"]["growth_n"]
    for n in g["n"]:
        check_timing(g["cached"][str(n)])
    for n, t in g["uncached"].items():
        check_timing(t)
        assert g["identical_tokens"][n] is True
        assert close(g["speedup"][n], t["median_s"] / g["cached"][n]["median_s"])
    r = g["ratio_hi_lo"]
    assert r["hi"] == max(g["n"]) == 2 * r["lo"]
    assert close(r["cached"], g["cached"][str(r["hi"])]["median_s"] / g["cached"][str(r["lo"])]["median_s"])
    assert close(r["uncached"], g["uncached"][str(r["hi"])]["median_s"]
                 / g["uncached"][str(r["lo"])]["median_s"])


def test_prefill_and_batch(run):
    _, data, _ = run
    for length, p in data["prefill"]["by_length"].items():
        for key in ("prefill", "token_by_token_scan", "token_by_token_loop"):
            check_timing(p[key])
        assert p["same_first_token"] is True
        one = p["prefill"]["median_s"]
        assert close(p["speedup_scan"], p["token_by_token_scan"]["median_s"] / one)
        assert close(p["speedup_loop"], p["token_by_token_loop"]["median_s"] / one)
        assert close(p["speedup_best"], min(p["speedup_scan"], p["speedup_loop"]))
    b = data["batch"]
    assert [int(k) for k in b["by_batch"]] == b["batches"]
    for batch, row in b["by_batch"].items():
        check_timing(row)
        assert row["new_tokens"] == int(batch) * b["new_per_row"]
        assert close(row["tokens_per_s"], row["new_tokens"] / row["median_s"])


def test_cache_memory_by_hand(run):
    _, data, _ = run
    memory = data["cache_memory"]
    names = [r["name"] for r in memory["configurations"]]
    assert names[:3] == ["seed", "growth", "growth, int8 cache"]
    for r in memory["configurations"]:
        assert r["formula_nbytes"] == r["arrays_nbytes"]
        assert 0 <= r["other_nbytes"] <= 8 * r["batch"]  # at most a counter per row
        rows = 2 * r["batch"] * r["blocks"] * r["max_len"] * r["kv_heads"]
        if r["cache_dtype"] == "int8":  # one byte per element and a float32 scale per row
            assert r["arrays_nbytes"] == rows * (r["head_dim"] + 4)
        else:
            assert r["arrays_nbytes"] == rows * r["head_dim"] * 4
    seed = memory["configurations"][0]
    # 2 (keys, values) x 2 blocks x 256 rows x 4 heads x 16 dims x 4 bytes.
    assert seed["arrays_nbytes"] == 2 * 2 * 256 * 4 * 16 * 4 == 262_144
    assert seed["weights_nbytes"] == 4 * data["seed"]["params"]
    tiny = data["sizes"]["growth"]
    head_dim = tiny["d_model"] // tiny["n_heads"]
    assert memory["exercise_3_nbytes"] == 2 * tiny["n_blocks"] * 512 * tiny["n_heads"] * head_dim * 4


def test_step_and_roofline(run):
    _, data, _ = run
    s = data["step_vs_max_len"]
    assert [int(k) for k in s["by_max_len"]] == s["max_lens"]
    for row in s["by_max_len"].values():
        check_timing(row)
    r = s["ratio_hi_lo"]
    assert close(r["ratio"], s["by_max_len"][str(r["hi"])]["median_s"]
                 / s["by_max_len"][str(r["lo"])]["median_s"])
    profile = s["hlo_full_cache_ops"]
    assert profile["max_len"] == r["hi"] and profile["count"] == len(profile["instructions"])

    ro = data["roofline"]
    tiny = data["sizes"]["growth"]
    head_dim = tiny["d_model"] // tiny["n_heads"]
    assert ro["cache_row_nbytes"] == 2 * tiny["n_blocks"] * tiny["n_heads"] * head_dim * 4
    assert ro["weights_nbytes"] == 4 * data["growth"]["params"]
    assert ro["bytes_per_step"] == ro["weights_nbytes"] + (ro["pos"] + 1) * ro["cache_row_nbytes"]
    assert ro["step_median_s"] == s["by_max_len"][str(tiny["max_len"])]["median_s"]
    assert close(ro["achieved_bytes_per_s"], ro["bytes_per_step"] / ro["step_median_s"])
    assert close(ro["fraction"], ro["achieved_bytes_per_s"] / ro["machine_bytes_per_s"])
    copy = ro["memory_copy"]
    assert close(copy["bytes_per_s"], 2 * copy["array_nbytes"] / copy["best_s"])
    assert copy["best_s"] == min(copy["times_s"])
    small = ro["memory_copy_step_working_set"]
    assert abs(2 * small["array_nbytes"] - ro["bytes_per_step"]) <= 8  # source + destination
    assert close(ro["fraction_vs_step_working_set_copy"], ro["achieved_bytes_per_s"] / small["bytes_per_s"])
    assert close(ro["fraction_fastest_step"],
                 ro["bytes_per_step"] / s["by_max_len"][str(tiny["max_len"])]["min_s"]
                 / ro["machine_bytes_per_s"])


def test_targets_and_outputs(run):
    out, data, stdout = run
    assert data["mode"] == "tiny"
    machine = data["machine"]
    for key in ("cpu_model", "cpu_count", "python", "jax", "jaxlib", "equinox", "numpy", "date",
                "backend", "cpu_caches"):
        assert machine[key] not in (None, "")
    ops = {">=": lambda a, b: a >= b, "<=": lambda a, b: a <= b}
    assert len(data["targets"]) == 14
    for t in data["targets"]:
        op, bound = t["target"].split()
        if t["measured"] is None:
            assert t["met"] is None
        else:
            assert t["met"] is ops[op](t["measured"], float(bound))
    measured = [t["measured"] for t in data["targets"]]
    assert measured[0] == data["speedup_median"]
    assert measured[5] == data["roofline"]["fraction"]
    assert measured[6:] == [
        data["floor"]["ratio_median"],
        data["long_max_len"]["ratio_median"],
        data["long_max_len"]["peak_memory"]["growth_nbytes"] / 2**20,
        data["roofline_in_generate"]["fraction_of_working_set_copy"],
        data["batch_matmul"]["fraction_of_matmul"],
        data["first_call"]["new_lengths"]["compiles"],
        None,  # the fresh-process first calls: bench/first_call.py's test runs them
        None,
    ]
    budget = data["long_max_len"]["peak_memory"]["cache_nbytes"] / 4 / 2**20
    assert data["targets"][8]["target"] == f"<= {budget:g}"
    for path in data["figures"]:
        assert pathlib.Path(path).parent == out
        assert pathlib.Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "seed protocol" in stdout and "targets:" in stdout
    assert sum(data["section_wall_s"].values()) <= data["wall_s"] + 1e-6


def test_floor(run):
    _, data, _ = run
    f = data["floor"]
    for key in ("eqrope", "eqrope_stacked", "floor", "stacked_floor"):
        check_timing(f[key], repeats=data["sizes"]["floor_repeats"])
    assert f["tokens_equal"] is True
    assert close(f["ratio_median"], f["eqrope"]["median_s"] / f["floor"]["median_s"])
    assert close(f["ratio_stacked_floor"], f["stacked_floor"]["median_s"] / f["floor"]["median_s"])
    assert f["max_new"] == data["seed"]["max_new"]
    # The smallest power of two (at least 16) holding the prompt of 8 and the new tokens.
    length = max(16, 8 + f["max_new"])
    assert f["floor_cache_len"] == min(1 << (length - 1).bit_length(), 256)


def test_first_call(run):
    _, data, _ = run
    fc = data["first_call"]
    b = fc["breakdown"]
    assert b["first_s"] == data["cache"]["first_s"] and b["compiles"] >= 1
    assert close(b["first_s"], b["trace_s"] + b["lower_s"] + b["compile_s"] + b["run_and_python_s"])
    nl = fc["new_lengths"]
    assert nl["compiles"] == sum(c["compiles"] for c in nl["calls"])
    for c in nl["calls"]:
        assert c["default_cache_len"] == nl["cache_len"]
        assert c["tokens_len"] == c["prompt_len"] + c["max_new"]
        assert len(c["compiled"]) == c["compiles"]
        assert close(c["ratio"], c["new_call_s"] / c["repeat_call_s"])
    assert nl["new_call_s_max"] == max(c["new_call_s"] for c in nl["calls"])
    assert "fresh" not in fc  # tests/test_bench_first_call.py runs the fresh-process rows
    d = fc["depth"]
    assert [r["n_blocks"] for r in d["rows"]] == data["sizes"]["depths"]
    for r in d["rows"]:
        check_timing(r, repeats=1)
    assert close(d["first_call_ratio"], d["rows"][-1]["first_s"] / d["rows"][0]["first_s"])


def test_long_max_len(run):
    _, data, _ = run
    lo = data["long_max_len"]
    assert lo["max_lens"] == {"short": 256, "long": data["sizes"]["long_max_len"]}
    for key in ("short", "long"):
        check_timing(lo[key], repeats=data["sizes"]["long_repeats"])
    assert close(lo["ratio_median"], lo["long"]["median_s"] / lo["short"]["median_s"])
    assert lo["identical_tokens"] is True
    # The seed's sizes: 2 (keys, values) x 2 blocks x 4 heads x 16 dims x 4 bytes per row.
    assert lo["cache_nbytes_model_max_len"] == {k: 1024 * v for k, v in lo["max_lens"].items()}
    mem = lo["peak_memory"]
    assert mem["cache_nbytes"] == 1024 * data["sizes"]["memory_max_len"]
    assert mem["growth_nbytes"] == mem["maxrss_after_nbytes"] - mem["maxrss_before_nbytes"]
    assert mem["tokens_len"] == mem["prompt_len"] + mem["max_new"]


def test_what_bounds_a_step(run):
    _, data, _ = run
    ro = data["roofline_in_generate"]
    check_timing(ro["generate"], repeats=data["sizes"]["bound_repeats"])
    assert ro["new_tokens"] == max(data["growth"]["n"])
    assert ro["weights_nbytes"] == data["roofline"]["weights_nbytes"]
    assert ro["cache_row_nbytes"] == data["roofline"]["cache_row_nbytes"]
    assert ro["mean_rows_read"] == ro["prompt_len"] + ro["new_tokens"] / 2
    assert ro["bytes_per_token"] == ro["weights_nbytes"] + ro["mean_rows_read"] * ro["cache_row_nbytes"]
    assert close(ro["tokens_per_s"], ro["new_tokens"] / ro["generate"]["median_s"])
    assert close(ro["achieved_bytes_per_s"], ro["tokens_per_s"] * ro["bytes_per_token"])
    for key, nbytes in (("copy_working_set", ro["bytes_per_token"]),
                        ("copy_dram", data["sizes"]["copy_mb"] * 2**20)):
        copy = ro[key]
        check_timing(copy, repeats=data["sizes"]["bound_repeats"])
        assert abs(copy["buffer_nbytes"] - nbytes) < 4
        assert close(copy["bytes_per_s"], 2 * copy["buffer_nbytes"] * copy["passes"] / copy["median_s"])
    assert close(ro["fraction_of_working_set_copy"],
                 ro["achieved_bytes_per_s"] / ro["copy_working_set"]["bytes_per_s"])
    assert close(ro["fraction_of_dram_copy"], ro["achieved_bytes_per_s"] / ro["copy_dram"]["bytes_per_s"])

    bm = data["batch_matmul"]
    tiny = data["sizes"]["growth"]
    d, ff, blocks = tiny["d_model"], tiny["d_ff"] or 4 * tiny["d_model"], tiny["n_blocks"]
    assert bm["matmul_params"] == blocks * (d * 3 * d + d * d + d * 2 * ff + ff * d) + d * tiny["vocab_size"]
    assert bm["matmul_params"] == sum(k * n for _, k, n in bm["shapes"])
    assert all(m == bm["batch"] == data["sizes"]["bound_batch"] for m, _, _ in bm["shapes"])
    for key in ("generate", "matmul"):
        check_timing(bm[key], repeats=data["sizes"]["bound_repeats"])
    assert close(bm["tokens_per_s"], bm["batch"] * bm["new_per_row"] / bm["generate"]["median_s"])
    assert close(bm["decode_flops_per_s"], 2 * bm["matmul_params"] * bm["tokens_per_s"])
    assert close(bm["matmul_flops_per_s"], 2 * bm["batch"] * bm["matmul_params"] / bm["matmul"]["median_s"])
    assert close(bm["fraction_of_matmul"], bm["decode_flops_per_s"] / bm["matmul_flops_per_s"])


def test_floor_matches_eqrope_with_gqa_and_a_head_bias(monkeypatch):
    """The floor reads eqrope's arrays: grouped key/value heads, a non-zero head bias."""
    monkeypatch.syspath_prepend(str(BENCH))
    floor = load("_floor")
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np

    import eqrope

    model = eqrope.RotaryDecoder(97, 64, 4, 3, 64, n_kv_heads=2, rope_base=500.0, norm_eps=1e-6,
                                 key=jax.random.PRNGKey(1))
    bias = jax.random.normal(jax.random.PRNGKey(2), model.head_bias.shape)
    model = eqx.tree_at(lambda m: m.head_bias, model, bias)
    prompt = jnp.arange(5, dtype=jnp.int32)
    weights, sizes = floor.floor_weights(model)
    ours = floor.floor_generate(weights, prompt, s=sizes, max_new=40, cache_len=64)
    unrolled = floor.floor_generate_unrolled(
        floor.unrolled_weights(weights), prompt, s=sizes, max_new=40, cache_len=64
    )
    reference = np.asarray(eqrope.generate(model, prompt, 40))
    assert np.array_equal(np.asarray(ours), reference)
    assert np.array_equal(np.asarray(unrolled), reference)


def test_time_calls_interleaves(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    timing = load("_timing")
    calls = []
    fns = {name: (lambda name=name: calls.append(name) or len(calls)) for name in "ab"}
    t = timing.time_calls(fns, repeats=2, warmup=1)
    assert calls == ["a", "b", "a", "b", "a", "b"]
    assert t["a"]["result"] == 5 and t["b"]["result"] == 6
    assert all(len(r["times_s"]) == 2 and r["first_compiles"] == 0 for r in t.values())


def test_time_call_counts_calls():
    timing = load("_timing")
    calls = []

    def fn():
        calls.append(None)
        return len(calls)

    t = timing.time_call(fn, repeats=3, warmup=2)
    assert len(calls) == 5 and t["result"] == 5 and len(t["times_s"]) == 3
    calls.clear()
    t = timing.time_call(fn, repeats=3, warmup=0)  # the first call is the first repeat
    assert len(calls) == 3 and t["times_s"][0] == t["first_s"]
    with pytest.raises(ValueError, match="repeats"):
        timing.time_call(fn, repeats=0)
    assert "result" not in timing.without_result(t)


def test_default_output_is_ignored_by_git():
    timing = load("_timing")
    assert timing.results_folder(save=True) == BENCH / "results"
    latest = timing.results_folder(save=False) / "kv_cache_cpu.json"
    proc = subprocess.run(["git", "check-ignore", "-q", str(latest)], cwd=ROOT)
    if proc.returncode == 128:
        pytest.skip("not a git checkout")
    assert proc.returncode == 0, f"{latest} is not ignored by git"


def test_full_cache_ops_reads_hlo(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # as when it runs as a script: _timing beside it
    roofline = load("_roofline")
    hlo = "\n".join([
        "%fused_computation.1 (p: f32[4,512,2,8]) -> f32[512,2,8] {",
        "  %dynamic_slice.1 = f32[1,512,2,8]{3,2,1,0} dynamic-slice(%p, %i), metadata={}",
        "}",
        "ENTRY %main.3 (cache: f32[4,512,2,8]) -> f32[4,512,2,8] {",
        "  %cache = f32[4,512,2,8]{3,2,1,0} parameter(0)",
        '  %copy_fusion = f32[512,2,8]{2,1,0} fusion(%cache), kind=kLoop, metadata={op_name="jit(step)/slice"}',
        "  ROOT %dynamic-update-slice_fusion = f32[4,512,2,8]{3,2,1,0} fusion(%cache, %x), kind=kLoop",
        "  %small = f32[2,8]{1,0} fusion(%cache)",
        "}",
    ])
    ops = roofline.full_cache_ops(hlo, 512)
    assert [o["instruction"] for o in ops] == ["copy_fusion", "dynamic-update-slice_fusion"]
    assert [o["in_place_update"] for o in ops] == [False, True]
    assert ops[0]["nbytes"] == 512 * 2 * 8 * 4 and ops[0]["source"] == "jit(step)/slice"


def test_ci_runs_the_tiny_bench_with_the_smoke_flags():
    # The run the fixture above reads when .ci/run gives it must be the one it would make.
    from _bench import SMOKE_FLAGS

    assert f'XLA_FLAGS="{SMOKE_FLAGS}" python bench/kv_cache.py --tiny' in (ROOT / ".ci" / "run").read_text()
