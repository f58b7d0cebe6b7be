"""eqrope.Engine on device meshes against the one-device engine, and its mesh arguments.

The `multidevice` test runs `tests/engine_mesh_checks.py` once, in a subprocess with 8
virtual CPU devices, for (8,1), (2,4) and (1,8) meshes: every request's tokens (greedy,
sampled with its key, penalties, EOS ids, two samples of one prompt) equal the one-device
engine's, every page is back in its shard's pool, nothing compiles after `warmup`, the
arrays lie where the rules say, and the requests spread over the shards. A second
`multidevice` test runs it as two processes of 4 devices under `jax.distributed`, one
engine over both (process 0 leading, `eqrope.serving.lead`/`follow`), against the same
one-device tokens. The other tests need one device.
"""

import concurrent.futures
import socket
import subprocess
import sys

import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType
from _models import random_model
from test_sharding_devices import ROOT, cpu_env, eight_device_report, parse

import eqrope
from eqrope.serving._mesh_layout import check_pages, data_shards, decode_slots, place_rows


SCRIPT = str(ROOT / "tests" / "engine_mesh_checks.py")


@pytest.fixture(scope="module")
def reference_file(tmp_path_factory):
    return tmp_path_factory.mktemp("engine_mesh") / "reference.json"


@pytest.fixture(scope="module")
def report(reference_file):
    return eight_device_report(SCRIPT, reference_file, ROOT / "tests")


@pytest.mark.multidevice
def test_mesh_engines_equal_one_device(report):
    reference = report["reference"]
    assert len(reference) == 12 and len(reference[5]) == 2  # two samples of request 5
    assert sum(len(sample) for request in reference for sample in request) > 100
    assert set(report["meshes"]) == {"8,1", "2,4", "1,8"}
    for name, run in report["meshes"].items():
        for i, (mine, theirs) in enumerate(zip(run["tokens"], reference)):
            assert mine == theirs, (name, i, mine, theirs)


@pytest.mark.multidevice
def test_mesh_engines_free_every_page_and_compile_nothing_after_warmup(report):
    for name, run in report["meshes"].items():
        stats = run["stats"]
        assert stats["pages_used"] == 0 and stats["pages_free"] == stats["pages_total"], (name, stats)
        assert stats["running"] == stats["waiting"] == stats["prefilling"] == 0
        assert stats["pages_cached"] > 0  # the shared prefix was registered (and is reusable)
        assert sum(run["compiles"].values()) == 0, (name, run["compiles"])


@pytest.mark.multidevice
def test_mesh_engines_place_slots_pages_and_weights(report):
    runs = report["meshes"]
    assert {name: run["shards"] for name, run in runs.items()} == {"8,1": 8, "2,4": 2, "1,8": 1}
    # The pool, (kv_heads 8, pages 16 * 64 / 8 + D, page_size 8, head_dim 8): pages split
    # over data, heads over model. The slots' tokens, (16, 64): slots over data. The
    # fused q/k/v weight, (d_model 64, 3 * 64): columns over model.
    pools = {"8,1": [8, 136 // 8, 8, 8], "2,4": [2, 130 // 2, 8, 8], "1,8": [1, 129, 8, 8]}
    texts = {"8,1": [2, 64], "2,4": [8, 64], "1,8": [16, 64]}
    weights = {"8,1": [64, 192], "2,4": [64, 48], "1,8": [64, 24]}
    for name, run in runs.items():
        assert run["pool_shard"] == pools[name], name
        assert run["text_shard"] == texts[name], name
        assert run["wqkv_shard"] == weights[name], name
    # Requests spread over the shards: every shard of the (8,1) mesh served some.
    assert sorted(set(runs["8,1"]["admitted_to"])) == list(range(8))
    assert sorted(set(runs["2,4"]["admitted_to"])) == [0, 1]


@pytest.mark.multidevice
def test_two_processes_serve_as_one_engine(report, reference_file):
    """Two processes of 4 CPU devices under `jax.distributed`, one engine on a (4,2) mesh
    over both: process 0 decides and reads, process 1 replays its device calls; the
    tokens equal the one-device engine's."""
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        port = probe.getsockname()[1]

    def run(i):  # `subprocess.run` kills a process past its timeout
        command = [sys.executable, SCRIPT, "--process", str(i), "--of", "2", "--coordinator",
                   f"localhost:{port}", "--reference", str(reference_file)]  # fmt: skip
        return subprocess.run(command, env=cpu_env(4), cwd=ROOT / "tests", capture_output=True, text=True, timeout=600)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        done = list(pool.map(run, range(2)))
    for proc in done:
        assert proc.returncode == 0, proc.stderr[-4000:]
    results = [parse(proc.stdout) for proc in done]
    assert [(r["process"], r["count"]) for r in results] == [(0, 2), (1, 2)]
    leader = results[0]
    assert leader["reference"] == report["reference"][:6]  # the 8-device run's one-device engine
    assert leader["tokens"] == leader["reference"]
    assert leader["pages_free"] == leader["pages_total"]


@pytest.mark.multidevice
def test_two_processes_serve_http_as_one_server(tmp_path, monkeypatch):
    """`python -m eqrope.serve` as a `jax.distributed` job of two processes of 4 CPU
    devices on an (8,1) mesh: process 0 answers HTTP, process 1 follows; greedy
    completions of token prompts equal `eqrope.generate`'s, and both exit 0 on SIGTERM."""
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    httpx = pytest.importorskip("httpx")
    from _serve import free_port, serve, write_checkpoint

    checkpoint = write_checkpoint(tmp_path / "checkpoint", max_len=64)
    env = cpu_env(4)
    for name in ("XLA_FLAGS", "JAX_PLATFORMS"):  # `serve` starts its process with os.environ
        monkeypatch.setenv(name, env[name])
    # One prefill piece size (16, the prompts' longest is 5): 3 prefill programs to warm up
    # in each process instead of the default chunk's 9.
    common = ["--slots", "8", "--max-len", "64", "--prefill-chunk", "16", "--mesh", "8,1",
              "--coordinator", f"localhost:{free_port()}", "--num-processes", "2"]  # fmt: skip
    follower = subprocess.Popen(
        [sys.executable, "-m", "eqrope.serve", str(checkpoint), "--port", str(free_port()), *common, "--process-id", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    prompts = [[0, 5, 6, 7, 8], [0, 9, 10], [0, 11, 12, 13]]
    try:
        with serve(checkpoint, *common, "--process-id", "0", log_dir=tmp_path) as served:
            body = {"model": "", "prompt": prompts, "max_tokens": 8, "temperature": 0}
            answer = httpx.post(served.url + "/v1/completions", json=body, timeout=300).json()
        assert served.process.returncode == 0, served.text()
        log, _ = follower.communicate(timeout=120)
        assert follower.returncode == 0, log[-4000:]
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.communicate()
    model, tokenizer = eqrope.from_hf(checkpoint), eqrope.Tokenizer.from_pretrained(checkpoint)
    texts = {c["index"]: c["text"] for c in answer["choices"]}
    for i, prompt in enumerate(prompts):
        new = np.asarray(eqrope.generate(model, np.asarray(prompt, np.int32), 8, eos_id=1))[len(prompt) :].tolist()
        new = new[: new.index(1)] if 1 in new else new
        assert texts[i] == tokenizer.decode(new, skip_special_tokens=True), (i, texts[i])


# -- one device: the layout and the arguments ----------------------------------------------


def test_rows_are_laid_out_per_shard():
    n, placed = place_rows([["a"], [], ["b", "c"]], (1, 2, 4))
    assert n == 2 and placed == [(0, "a"), (4, "b"), (5, "c")]
    slots = [None] * 6  # 3 shards of 2 slots

    class Running:
        finish_reason = None

        def __init__(self, slot):
            self.slot = slot

    slots[1], slots[4] = Running(1), Running(4)
    groups = [[slots[1]], [], [slots[4]]]
    assert decode_slots(slots, groups, 2) == [1, 0, 2, 3, 4, 5]


@pytest.fixture(scope="module")
def model():
    return random_model(0, 32, 16, 2, 1, 32)


def test_mesh_arguments_are_checked(model):
    mesh = eqrope.make_mesh(1, 1)
    with pytest.raises(ValueError, match="pass mesh= too"):
        eqrope.Engine(model, slots=2, prefill_chunk=16, rules=eqrope.ShardingRules())
    with pytest.raises(ValueError, match="ShardingRules.batch"):
        eqrope.Engine(model, slots=2, prefill_chunk=16, mesh=mesh, rules=eqrope.ShardingRules(batch=None))
    with pytest.raises(ValueError, match="mesh axis 'rows'"):
        eqrope.Engine(model, slots=2, prefill_chunk=16, mesh=mesh, rules=eqrope.ShardingRules(batch="rows"))


def test_a_one_device_mesh_equals_no_mesh(model):
    prompts = [np.arange(3, 3 + k, dtype=np.int32) % 32 for k in (2, 9, 5)]
    config = eqrope.GenerationConfig(max_new=6, temperature=1.0)
    # One decode bucket (the default's are 1 and 2 slots): half the decode programs.
    plain = eqrope.Engine(model, slots=2, max_len=32, prefill_chunk=16, decode_buckets=(2,)).generate(prompts, config)
    engine = eqrope.Engine(model, slots=2, max_len=32, prefill_chunk=16, decode_buckets=(2,), mesh=eqrope.make_mesh(1, 1))
    meshed = engine.generate(prompts, config)
    assert [c.tokens.tolist() for c in meshed] == [c.tokens.tolist() for c in plain]
    assert engine.stats.pages_free == engine.stats.pages_total


def test_shards_must_split_slots_and_pages():
    mesh = AbstractMesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))
    assert data_shards(mesh, None, 8) == 4
    with pytest.raises(ValueError, match="slots=6 must split evenly over the 4 data shards"):
        data_shards(mesh, None, 6)
    assert check_pages(12, 4) == 3
    with pytest.raises(ValueError, match="pass pages=12"):
        check_pages(10, 4)
    with pytest.raises(ValueError, match="pass pages=8"):
        check_pages(4, 4)  # one page a shard: only its null page
