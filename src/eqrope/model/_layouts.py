"""The two block layouts, stacked and unstacked: their names, and running the blocks in each.

Stacked blocks run as one `jax.lax.scan` step each; unstacked ones by a Python `for`,
each block reading its own arrays (and, when decoding, its own cache buffers) in place.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from ._matmul import LOW_PRECISION, converted_in_step


LAYOUTS = ("stacked", "unstacked")


def decoding_layout(dtype, backend: str | None = None) -> str:
    """The layout `from_hf` and `load` give a model of `dtype` by default: the one its
    `generate` calls read in place and compile fastest.

    `"unstacked"`, except a bfloat16 or float16 model on the CPU (`backend`, default
    JAX's), which is `"stacked"`: its steps convert each weight to float32 inside the
    step in either layout, so a stacked model is read in place too, and its prefill is
    then a scan over blocks, which compiles in about half the time at SmolLM2's 30
    blocks. See docs/kv_cache.md, "Which layout when".
    """
    backend = jax.default_backend() if backend is None else backend
    return "stacked" if jnp.dtype(dtype) in LOW_PRECISION and backend == "cpu" else "unstacked"


def check_layout(layout, name: str) -> str:
    """`layout` if it is one of `LAYOUTS`; otherwise a `ValueError` naming `name`."""
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(
            f"{name} must be 'stacked' (training: a scan over blocks) or 'unstacked' "
            f"(generation: one buffer per block), got {layout!r}."
        )
    return layout


def block_windows(config) -> Int[Array, " blocks"] | None:
    """Each block's sliding window (a block without one sees every position: the
    window is then past any position), or `None` when no block has one."""
    attention, n_blocks = config.attention, config.n_blocks
    if attention.window is None:
        return None
    everything = jnp.iinfo(jnp.int32).max // 2
    return jnp.asarray(
        [attention.window if w else everything for w in attention.windowed(n_blocks)],
        jnp.int32,
    )


def scan_blocks(blocks, config, x, positions, cache, kv_bound, kv_low):
    """The stacked blocks, one `jax.lax.scan` step each.

    With a cache (a prefill), low-precision arrays on the CPU are not the scan's
    inputs: XLA:CPU would convert each whole stack to float32 before the loop in
    order to slice it (see `_matmul.py`). Each step takes its block out of the stack
    itself, behind an optimization barrier with its input, so the slice and its
    conversion stay inside the step. Without a cache (training) the scan slices them,
    and reverse mode stacks the blocks' gradients as its outputs.
    """
    dynamic, static = eqx.partition(blocks, eqx.is_array)
    in_step = cache is not None and any(map(converted_in_step, jax.tree.leaves(dynamic)))

    def run_block(block_arrays, x, past, window):
        return eqx.combine(block_arrays, static)(x, positions, past, window)

    if config.remat:
        run_block = eqx.filter_checkpoint(run_block)

    def body(x, xs):
        block_arrays, index, window = xs
        if in_step:
            _, stack = jax.lax.optimization_barrier((x, dynamic))
            take = lambda a: jax.lax.dynamic_index_in_dim(a, index, keepdims=False)
            block_arrays = jax.tree.map(take, stack)
        # The whole cache is closed over and each block reads its rows in place.
        past = None if cache is None else cache.block(index, kv_bound, kv_low)
        x, k, v = run_block(block_arrays, x, past, window)
        return x, (k, v)

    indices = jnp.arange(config.n_blocks, dtype=jnp.int32)
    xs = (None if in_step else dynamic, indices, block_windows(config))
    x, (keys, values) = jax.lax.scan(body, x, xs)
    return x, keys, values


def unroll_blocks(blocks, config, x, positions, cache, kv_bound, kv_low):
    """The unstacked blocks, by a Python `for`: each reads its own arrays in place."""
    windows = block_windows(config)
    run = lambda block, x, past, window: block(x, positions, past, window)
    if config.remat:
        run = eqx.filter_checkpoint(run)
    keys, values = [], []
    for index, block in enumerate(blocks):
        past = None
        if cache is not None:  # a per-block cache is indexed by the Python int
            where = index if cache.per_block else jnp.asarray(index, jnp.int32)
            past = cache.block(where, kv_bound, kv_low)
        x, k, v = run(block, x, past, None if windows is None else windows[index])
        keys.append(k)
        values.append(v)
    return x, jnp.stack(keys), jnp.stack(values)


def decode_in_place(blocks, config, x, positions, cache, kv_bound, kv_low):
    """The unstacked blocks against a per-block float cache: each block writes its
    new rows into its own buffers, then attends to them in one pass
    ([`eqrope.DecoderBlock.decode`][]). **Returns:** `(x, cache)`."""
    windows = block_windows(config)
    for index, block in enumerate(blocks):
        window = None if windows is None else windows[index]
        x, cache = block.decode(x, positions, cache, index, window, kv_bound, kv_low)
    return x, cache
