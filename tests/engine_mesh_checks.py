"""eqrope.Engine on (8,1), (2,4) and (1,8) meshes of 8 virtual CPU devices, against one device.

Run by `tests/test_engine_mesh.py` in a subprocess (the device count is fixed when JAX
starts): `XLA_FLAGS=--xla_force_host_platform_device_count=8 python
tests/engine_mesh_checks.py` prints one `RESULT {json}` line: each request's tokens from
the one-device engine and from each mesh's, what each mesh engine compiled after its
`warmup`, its pool after the last request, where its arrays lie and which shards its
requests ran on. Runs with the test session's checks (jaxtyping + beartype on eqrope,
strict dtype promotion).

With `--process I --of 2 --coordinator localhost:PORT` (4 devices per process) it is one
of two processes joined by `jax.distributed.initialize`: one engine on a (4,2) mesh over
both, process 0 leading (`eqrope.serving.lead`) and process 1 following; process 0
prints its tokens beside the one-device engine's, which the 8-device run saved
(`--save FILE` there, `--reference FILE` here).
"""

import json
import sys

import jax
from jaxtyping import install_import_hook


jax.config.update("jax_numpy_dtype_promotion", "strict")
with install_import_hook("eqrope", "beartype.beartype"):
    import eqrope
    import eqrope.serving
    from eqrope.generation._arrays import rebuild

import numpy as np
from _compiles import counting
from _models import random_model


VOCAB, MAX_LEN, SLOTS = 64, 64, 16
ENGINE = dict(slots=SLOTS, page_size=8, max_len=MAX_LEN, prefill_chunk=16, prefill_rows=2, decode_steps=4)
MESHES = ((8, 1), (2, 4), (1, 8))


def requests():
    """Twelve requests, a long tail of lengths: greedy and sampled, penalties, EOS ids, a
    shared prefix (cached pages) and two samples of one prompt (a copied page)."""
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, VOCAB, 16).tolist()
    prompts, configs = [], []
    for i in range(12):
        head = prefix if i % 4 == 0 else []
        prompts.append(np.asarray(head + rng.integers(0, VOCAB, int(rng.integers(2, 20))).tolist(), np.int32))
        max_new = 24 if i % 5 == 0 else int(rng.integers(2, 8))
        configs.append(
            [
                eqrope.GenerationConfig(max_new=max_new),
                eqrope.GenerationConfig(max_new=max_new, temperature=1.0, top_k=20),
                eqrope.GenerationConfig(max_new=max_new, temperature=0.8, repetition_penalty=1.3),
                eqrope.GenerationConfig(max_new=max_new, eos_id=[3, 5, 7]),
            ][i % 4]
        )
    configs[5] = eqrope.GenerationConfig(max_new=6, temperature=1.0, num_samples=2)
    keys = [jax.random.key(100 + i) for i in range(len(prompts))]
    return prompts, configs, keys


def tokens(results) -> list:
    """Each request's tokens (a list per sample)."""
    return [[c.tokens.tolist() for c in (r if isinstance(r, list) else [r])] for r in results]


def local(x) -> list:
    """The shape of the part of `x` each device holds."""
    return list(x.sharding.shard_shape(x.shape))


def main(save: str | None):
    assert jax.device_count() == 8, jax.devices()
    model = random_model(0, VOCAB, 64, 8, 2, MAX_LEN, n_kv_heads=8, d_ff=128)
    prompts, configs, keys = requests()
    # One decode bucket of all the slots, as each mesh engine has one: the bucket changes
    # no token (the meshes' buckets are 2, 8 and 16 slots), and one compile beats five.
    reference = tokens(eqrope.Engine(model, decode_buckets=(SLOTS,), **ENGINE).generate(prompts, configs, keys=keys))
    report = {"devices": jax.device_count(), "reference": reference, "meshes": {}}
    if save:
        with open(save, "w") as file:
            json.dump(reference, file)
    for data, width in MESHES:
        mesh = eqrope.make_mesh(data, width)
        engine = eqrope.Engine(model, mesh=mesh, decode_buckets=(SLOTS // data,), **ENGINE)
        engine.warmup()
        admitted = engine.scheduler._admit_to
        shards = []  # the shard each request was admitted to, by the scheduler's own call
        engine.scheduler._admit_to = lambda r, d: admitted(r, d) and not shards.append(d)
        with counting() as c:
            results = engine.generate(prompts, configs, keys=keys)
        for pool in engine.scheduler.pools:
            pool.check()
        runner = engine.runner
        report["meshes"][f"{data},{width}"] = {
            "tokens": tokens(results),
            "compiles": dict(c.compiles),
            "stats": engine.stats.__dict__,
            # The part of each array one device holds.
            "pool_shard": local(runner.pool.keys[0]),
            "text_shard": local(runner.text.tokens),
            "wqkv_shard": local(rebuild(runner.arrays, runner.structure).blocks[0].attn.wqkv),
            "shards": engine.shards,
            "admitted_to": shards,
        }
    print("RESULT " + json.dumps(report))


def processes(process: int, count: int, coordinator: str, reference: str) -> None:
    jax.distributed.initialize(coordinator, num_processes=count, process_id=process)
    assert jax.device_count() == 8 and jax.local_device_count() == 4
    model = random_model(0, VOCAB, 64, 8, 2, MAX_LEN, n_kv_heads=8, d_ff=128)
    prompts, configs, keys = (part[:6] for part in requests())
    # Half the slots (2 a data shard; the 6 requests fit): fewer keys' derivations to warm up.
    engine = eqrope.Engine(model, mesh=eqrope.make_mesh(4, 2), **{**ENGINE, "slots": SLOTS // 2}, decode_buckets=(SLOTS // 8,))
    report = {"process": jax.process_index(), "count": jax.process_count()}
    if process == 0:
        with open(reference) as file:
            reference = json.load(file)[: len(prompts)]
        eqrope.serving.lead(engine)
        engine.warmup()
        report |= {"tokens": tokens(engine.generate(prompts, configs, keys=keys)), "reference": reference,
                   "pages_free": engine.stats.pages_free, "pages_total": engine.stats.pages_total}  # fmt: skip
        eqrope.serving.dismiss(engine)
    else:
        eqrope.serving.follow(engine)
    print("RESULT " + json.dumps(report))
    jax.distributed.shutdown()


if __name__ == "__main__":
    option = lambda name: sys.argv[sys.argv.index(name) + 1] if name in sys.argv else None
    if option("--process") is not None:
        processes(int(option("--process")), int(option("--of")), option("--coordinator"), option("--reference"))
    else:
        main(option("--save"))
