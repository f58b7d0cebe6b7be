"""Sharded training and generation against one device, on 8 virtual CPU devices.

Run by `tests/test_sharding_devices.py` in a subprocess, because the device count is fixed when
JAX starts: `XLA_FLAGS=--xla_force_host_platform_device_count=8 python
tests/multidevice_checks.py` prints one JSON object of measured differences, shardings
and collectives, which the test asserts on. Runs with the test session's settings
(jaxtyping + beartype checks on eqrope, strict dtype promotion).

With `--process I --of 2 --coordinator localhost:PORT` (and 4 devices per process) it is
one of two processes joined by `jax.distributed.initialize`, the multi-host launch on
one machine, and checks training and generation on the mesh that spans both.
"""

import collections
import json
import re
import sys
import time

import jax
import jax.monitoring
from jaxtyping import install_import_hook


jax.config.update("jax_numpy_dtype_promotion", "strict")
with install_import_hook("eqrope", "beartype.beartype"):
    import eqrope
    import eqrope.testing
    from eqrope.generation import _decode

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P


SIZES = dict(vocab_size=256, d_model=64, n_heads=8, n_blocks=2, max_len=32)
OPTIONS = dict(n_kv_heads=4, d_ff=96, bias=True)
BATCH, SEQ = 8, 16
# Traces by function name, counted from jax.monitoring events (the library keeps no counter).
TRACES = collections.Counter()
jax.monitoring.register_event_duration_secs_listener(
    lambda event, duration, **kw: TRACES.update([kw.get("fun_name")])
    if event == "/jax/core/compile/jaxpr_trace_duration"
    else None
)
# One-device results saved for the two-process run (`--save` / `--reference`).
REFERENCE = {}


def max_diff(a, b) -> float:
    """Largest absolute difference between the arrays of two pytrees of one structure, in
    NumPy on the gathered arrays (JAX would compile three small programs per shape and
    placement: ~40 compiles in this script)."""
    a, b = jax.tree.leaves(eqx.filter(a, eqx.is_array)), jax.tree.leaves(eqx.filter(b, eqx.is_array))
    assert len(a) == len(b) and all(x.shape == y.shape for x, y in zip(a, b))
    return max((float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(a, b)), default=0.0)


def spec_str(partition) -> str:
    """A partition spec as a string, trailing `None`s dropped (they mean the same)."""
    entries = list(partition)
    while entries and entries[-1] is None:
        entries.pop()
    return str(tuple(entries))


def spec(x) -> str:
    """The partition spec of a placed array."""
    return spec_str(x.sharding.spec)


def specs(tree) -> dict:
    """`{path: spec}` of every array of `tree`."""
    leaves = jax.tree_util.tree_flatten_with_path(eqx.filter(tree, eqx.is_array))[0]
    return {jax.tree_util.keystr(p): spec(x) for p, x in leaves}


def sharded_sizes(shape, partition) -> dict:
    """`{mesh axis: global size of the dimension split over it}`."""
    return {str(axis): size for size, axis in zip(shape, partition) if axis is not None}


def sharded_dims(tree) -> dict:
    """`{path: sharded_sizes}` of every array of `tree`."""
    leaves = jax.tree_util.tree_flatten_with_path(eqx.filter(tree, eqx.is_array))[0]
    return {jax.tree_util.keystr(p): sharded_sizes(x.shape, x.sharding.spec) for p, x in leaves}


def same_placement(a, b) -> bool:
    """Whether two pytrees of arrays are placed alike, array by array."""
    a, b = jax.tree.leaves(eqx.filter(a, eqx.is_array)), jax.tree.leaves(eqx.filter(b, eqx.is_array))
    return len(a) == len(b) and all(
        x.sharding.is_equivalent_to(y.sharding, x.ndim) for x, y in zip(a, b)
    )


def counter_json(counter) -> dict:
    return {f"{op} over {'+'.join(axes) or 'none'}": n for (op, axes), n in sorted(counter.items())}


def train_batch():
    ids = jax.random.randint(jax.random.key(1), (BATCH, SEQ), 0, SIZES["vocab_size"])
    targets = jax.random.randint(jax.random.key(2), (BATCH, SEQ), 0, SIZES["vocab_size"])
    return ids, targets


def generation_prompt():
    prompt = jax.random.randint(jax.random.key(3), (6, 9), 0, SIZES["vocab_size"])
    return prompt, jnp.array([9, 2, 6, 4, 1, 7], jnp.int32)


def check_training(out: dict) -> None:
    """One SGD-with-momentum step, twice, on two meshes, remat off and on.

    After the first step the momentum buffer equals the gradient, so the optimiser state
    gives the gradients without another compiled program.
    """
    optimizer = optax.sgd(0.1, momentum=0.9)
    step = eqrope.make_train_step(optimizer)
    ids, targets = train_batch()
    # The reference: one device, no remat (remat changes no number, only memory).
    model = eqrope.RotaryDecoder(**SIZES, **OPTIONS, key=jax.random.key(0))
    state = eqrope.init_optimizer(optimizer, model)
    ref1 = step(model, state, ids, targets)
    ref2 = step(*ref1[:2], ids, targets)
    REFERENCE["loss"] = np.asarray(ref1[2])
    for i, leaf in enumerate(jax.tree.leaves(eqx.filter(ref1[0], eqx.is_array))):
        REFERENCE[f"weight{i}"] = np.asarray(leaf)
    results = {}
    for remat in (False, True):
        model = eqrope.RotaryDecoder(**SIZES, **OPTIONS, remat=remat, key=jax.random.key(0))
        state = eqrope.init_optimizer(optimizer, model)
        for data, model_axis in ((2, 4), (8, 1)):
            mesh = eqrope.make_mesh(data=data, model=model_axis)
            placed = eqrope.shard((model, state), mesh)
            batch = eqrope.shard_batch((ids, targets), mesh)
            compiled = step.lower(*placed, *batch).compile()
            text = compiled.compiled.as_text()
            out1 = compiled(*placed, *batch)
            # The compiled program checks its inputs' shardings, so this second call
            # fails if the step returned the model or state sharded differently.
            out2 = compiled(*out1[:2], *batch)
            name = f"data={data},model={model_axis},remat={remat}"
            results[name] = {
                "loss": abs(float(ref1[2]) - float(out1[2])),
                "grads": max_diff(ref1[1][0].trace, out1[1][0].trace),
                "weights": max_diff(ref1[0], out1[0]),
                "loss_step2": abs(float(ref2[2]) - float(out2[2])),
                "weights_step2": max_diff(ref2[0], out2[0]),
                "grads_size": max_diff(ref1[1][0].trace, jax.tree.map(np.zeros_like, ref1[1][0].trace)),
                "same_shardings": same_placement(placed, out1[:2]) and same_placement(placed, out2[:2]),
                "loss_spec": spec(out1[2]),
                "collectives": counter_json(eqrope.testing.hlo_collectives(text, mesh)),
                "local_wqkv": _has_shape(text, "f32[2,64,32]"),
                "global_wqkv": _has_shape(text, "f32[2,64,128]"),
            }
            if (data, model_axis) == (2, 4) and not remat:
                out["param_specs"] = specs(placed[0])
                out["param_sizes"] = sharded_dims(placed[0])
                out["momentum_specs"] = specs(placed[1][0].trace)
                out["updated_specs"] = specs(out1[0])
    out["training"] = results


def _has_shape(text: str, shape: str) -> bool:
    """Whether a compiled (per-device) program has a value of exactly this shape."""
    return re.search(re.escape(shape) + r"[{ ]", text) is not None


def check_forward_and_cache(out: dict) -> None:
    """A batched forward and a batched prefill with a sharded model and cache."""
    mesh = eqrope.make_mesh(data=2, model=4)
    model = eqrope.RotaryDecoder(**SIZES, **OPTIONS, key=jax.random.key(0))
    # Batch 2 and kv_heads 4: the sizes tell which dimension went where.
    ids = jax.random.randint(jax.random.key(4), (2, 12), 0, SIZES["vocab_size"])
    prefill = eqx.filter_jit(jax.vmap(lambda m, x, c: m.prefill(x, c, 0), in_axes=(None, 0, 0)))
    ref_logits, ref_cache = prefill(model, ids, model.init_cache(2))
    cache = eqrope.shard(model.init_cache(2), mesh)
    logits, new_cache = prefill(eqrope.shard(model, mesh), eqrope.shard_batch(ids, mesh), cache)
    # The same under jax_enable_x64, with int64 token ids.
    with jax.enable_x64(True):
        ids64 = eqrope.shard_batch(jnp.asarray(np.asarray(ids), jnp.int64), mesh)
        logits64, _ = prefill(eqrope.shard(model, mesh), ids64, cache)
    out["forward"] = {
        "logits": max_diff(ref_logits, logits),
        "logits_x64": max_diff(ref_logits, logits64),
        "cache": max_diff(ref_cache, new_cache),
        "cache_spec_in": spec(cache.keys),
        "cache_sizes": sharded_sizes(cache.keys.shape, cache.keys.sharding.spec),
        "cache_spec_out": spec(new_cache.keys),
        "logits_spec": spec(logits),
    }
    # Adam's moments follow the parameters; its step counter is replicated.
    adam = eqrope.shard(eqrope.init_optimizer(optax.adam(1e-3), model), mesh)
    out["adam_specs"] = {
        "mu.wqkv": spec(adam[0].mu.blocks.attn.wqkv),
        "nu.head": spec(adam[0].nu.head),
        "count": spec(adam[0].count),
    }


def check_generation(out: dict) -> None:
    """Greedy and sampled generation, a ragged batch of 6 on data, heads on model."""
    mesh = eqrope.make_mesh(data=2, model=4)
    model = eqrope.RotaryDecoder(**SIZES, **OPTIONS, key=jax.random.key(0))
    placed = eqrope.shard(model, mesh)
    prompt, lengths = generation_prompt()
    settings = [dict(), dict(temperature=0.9, top_k=50, key=jax.random.key(7))]
    refs = [
        eqrope.generate(model, prompt, 20, prompt_lengths=lengths, return_logprobs=True, **s)
        for s in settings
    ]
    REFERENCE["tokens"] = np.asarray(refs[0].tokens)
    traces_before = TRACES["generate_program"]
    program, calls = _decode.generate_program, []

    def recording(*args, **static):  # what `generate` passes its compiled program
        calls.append((args, static))
        return program(*args, **static)

    _decode.generate_program = recording
    try:
        gens = [
            eqrope.generate(
                placed, prompt, 20, prompt_lengths=lengths, return_logprobs=True, mesh=mesh, **s
            )
            for s in settings
        ]
    finally:
        _decode.generate_program = program
    traces = TRACES["generate_program"] - traces_before
    out["generation"] = {
        "traces": traces,
        "tokens_equal": [bool(np.array_equal(r.tokens, g.tokens)) for r, g in zip(refs, gens)],
        "lengths_equal": [bool(np.array_equal(r.lengths, g.lengths)) for r, g in zip(refs, gens)],
        "logprobs": max(max_diff(r.logprobs, g.logprobs) for r, g in zip(refs, gens)),
        "new_tokens": int(sum(int(np.sum(np.asarray(r.lengths) - np.asarray(lengths))) for r in refs)),
    }
    # The compiled program holds the cache as per-device blocks (batch / data, kv_heads
    # / model) and never at its global shape. It decodes on per-block buffers (the
    # unstacked layout), so each block's keys are one such buffer.
    abstract = jax.eval_shape(lambda: model.unstacked().init_cache(6))
    cache_sharding = eqrope.shardings(abstract, mesh).keys[0]
    # The program the greedy call ran, lowered with its own arguments: JAX's cache hands
    # back that compiled program (no second compile).
    args, static = calls[0]
    text = program.lower(*args, **static).compile().as_text()
    shape = abstract.keys[0].shape
    local = cache_sharding.shard_shape(shape)
    out["generation"]["cache_spec"] = spec_str(cache_sharding.spec)
    out["generation"]["cache_sizes"] = sharded_sizes(shape, cache_sharding.spec)
    out["generation"]["local_cache"] = _has_shape(text, "f32[" + ",".join(map(str, local)) + "]")
    out["generation"]["global_cache"] = _has_shape(text, "f32[" + ",".join(map(str, shape)) + "]")
    out["generation"]["collectives"] = counter_json(eqrope.testing.hlo_collectives(text, mesh))


def abstract_model(**options):
    """A decoder's structure and shapes without its arrays (`jax.eval_shape`)."""
    return jax.eval_shape(lambda: eqrope.RotaryDecoder(**SIZES, **options, key=jax.random.key(0)))


def check_errors(out: dict) -> None:
    """Rules that do not divide a dimension, and the wrong kind of mesh.

    The models are abstract (shapes only): the checks run before anything is placed.
    """
    mesh = eqrope.make_mesh(data=2, model=4)
    model = abstract_model()
    errors = {}
    cases = {
        "kv_heads": lambda: eqrope.shard(abstract_model(n_kv_heads=2), mesh),
        "batch": lambda: eqrope.shard(jax.eval_shape(lambda: model.init_cache(3)), mesh),
        "shard_batch": lambda: eqrope.shard_batch(jnp.zeros((3, 4), jnp.int32), mesh),
        "generate_batch": lambda: eqrope.generate(model, jnp.zeros((3, 4), jnp.int32), 2, mesh=mesh),
        "explicit": lambda: eqrope.shard(
            model, jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
        ),
        "missing_axis": lambda: eqrope.shard(model, jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))),
    }
    for name, fn in cases.items():
        try:
            fn()
            errors[name] = None
        except (ValueError, TypeError) as error:
            errors[name] = f"{type(error).__name__}: {error}"
    # With kv_heads replicated the same model shards; the fused qkv columns replicate.
    ok = eqrope.shardings(abstract_model(n_kv_heads=2), mesh, eqrope.ShardingRules(kv_heads=None))
    errors["kv_replicated_wqkv_spec"] = spec_str(ok.blocks.attn.wqkv.spec)
    errors["kv_replicated_wo_spec"] = spec_str(ok.blocks.attn.wo.spec)
    # The other layouts' arrays: GELU MLP, learned positions, tied head, LayerNorm.
    other = abstract_model(mlp="gelu", positions="learned", tie_embeddings=True, norm="layer", bias=True)
    leaves = jax.tree_util.tree_flatten_with_path(eqrope.shardings(other, mesh))[0]
    out["other_specs"] = {jax.tree_util.keystr(p): spec_str(s.spec) for p, s in leaves}
    out["errors"] = errors


def check_hlo_parser(out: dict) -> None:
    """`hlo_collectives` on small programs whose collectives are known by construction."""
    mesh = eqrope.make_mesh(data=2, model=4)
    x = jnp.arange(64.0, dtype=jnp.float32).reshape(8, 8)
    cases = {
        "sum_rows_data": (P("data", None), P(), lambda x: jnp.sum(x, axis=0)),
        "sum_columns_model": (P(None, "model"), P(), lambda x: jnp.sum(x, axis=1)),
        "replicate_all": (P("data", "model"), P(), lambda x: x * 2),
        "roll_rows_data": (P("data", None), P("data", None), lambda x: jnp.roll(x, 1, axis=0)),
    }
    found = {}
    for name, (spec_in, spec_out, f) in cases.items():
        xs = jax.device_put(x, NamedSharding(mesh, spec_in))
        f = jax.jit(f, out_shardings=NamedSharding(mesh, spec_out))
        found[name] = counter_json(eqrope.testing.hlo_collectives(f.lower(xs).compile().as_text(), mesh))
    out["hlo_parser"] = found


def check_processes(out: dict, reference: dict) -> None:
    """The same training step and generation, with the 8 devices split over processes.

    Every process runs this same code after `jax.distributed.initialize`; the mesh spans
    all processes' devices and each process passes the same global arrays. The results
    are compared with the one-device `reference` the single-process run saved.
    """
    mesh = eqrope.make_mesh(data=2, model=4)
    optimizer = optax.sgd(0.1, momentum=0.9)
    step = eqrope.make_train_step(optimizer)
    model = eqrope.RotaryDecoder(**SIZES, **OPTIONS, key=jax.random.key(0))
    state = eqrope.init_optimizer(optimizer, model)
    ids, targets = train_batch()
    placed = eqrope.shard((model, state), mesh)
    new_model, _, loss = step(*placed, *eqrope.shard_batch((np.asarray(ids), np.asarray(targets)), mesh))
    # Each process can read only its own shards of the updated weights.
    leaves = jax.tree.leaves(eqx.filter(new_model, eqx.is_array))
    weights = [
        float(np.max(np.abs(np.asarray(shard.data) - reference[f"weight{i}"][shard.index])))
        for i, leaf in enumerate(leaves)
        for shard in leaf.addressable_shards
    ]
    prompt, lengths = generation_prompt()
    tokens = eqrope.generate(placed[0], prompt, 20, prompt_lengths=lengths, mesh=mesh)
    out["processes"] = {
        "process": jax.process_index(),
        "count": jax.process_count(),
        "local_devices": jax.local_device_count(),
        "loss": abs(float(loss) - float(reference["loss"])),
        "weights": max(weights),
        "tokens_equal": bool(np.array_equal(np.asarray(tokens), reference["tokens"])),
    }


def option(name: str) -> str | None:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else None


def report(out: dict) -> None:
    """One line `RESULT {json}` on stdout (Gloo logs to stdout too)."""
    print("RESULT " + json.dumps(out), flush=True)


def main() -> None:
    if option("--process") is not None:
        # One of several processes: `--process I --of N --coordinator HOST:PORT
        # --reference FILE.npz`.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            option("--coordinator"), num_processes=int(option("--of")), process_id=int(option("--process"))
        )
        out = {"devices": jax.device_count()}
        with np.load(option("--reference")) as reference:
            check_processes(out, dict(reference))
        report(out)
        return
    out = {"devices": jax.device_count()}
    if jax.device_count() != 8:
        raise SystemExit("Run with XLA_FLAGS=--xla_force_host_platform_device_count=8.")
    for check in (check_errors, check_hlo_parser, check_forward_and_cache, check_training, check_generation):
        start = time.perf_counter()
        check(out)
        out.setdefault("seconds", {})[check.__name__] = round(time.perf_counter() - start, 1)
    if option("--save") is not None:
        np.savez(option("--save"), **REFERENCE)
    report(out)


if __name__ == "__main__":
    main()
