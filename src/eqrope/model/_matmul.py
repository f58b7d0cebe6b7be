"""Products with a weight matrix, and a low-precision weight on XLA:CPU.

XLA:CPU has no bfloat16 (or float16) matrix product: it converts both operands to
float32 first. The conversion of a weight depends on the weight alone, so XLA moves it
out of every loop it sits in, the decode loop and the scan over blocks, and the program
then holds a float32 copy of every weight for its whole run: twice the bytes of a
bfloat16 model, on top of the model. A cast inside the step does not help: XLA moves it
just the same, and its scheduler runs all the moved-back casts of a loop body first.

`matmul` therefore ties the conversion of a low-precision weight to the product's input
`x`, so that each weight is converted inside its own step, when its product is next,
and only one float32 weight at a time is alive (see `in_step`). The product is computed as
XLA:CPU computed it before (float32 operands and sums, the result rounded to the
operands' dtype), though XLA may now round an intermediate it used to keep in float32;
each step reads the low-precision weight and writes and reads its float32 copy, so it
trades speed for memory. A float32 or float64 weight, an accelerator, and a weight that
is not an array all take plain `x @ w`, unchanged; a LoRA-wrapped weight's `__rmatmul__`
calls `matmul` on its base array, so that a zero update gives the base's product bit for
bit.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap
from jaxtyping import Array, Float

LOW_PRECISION = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def converted_in_step(w) -> bool:
    """Whether `matmul` converts `w` inside the step: a bfloat16 or float16 array, on
    the CPU."""
    return isinstance(w, jax.Array) and w.dtype in LOW_PRECISION and jax.default_backend() == "cpu"


def matmul(
    x: Float[Array, "seq d_in"], w: Float[Array, "d_in d_out"] | eqx.Module
) -> Float[Array, "seq d_out"]:
    """`x @ w`; a low-precision weight on the CPU is converted inside the step (module
    docstring)."""
    if not converted_in_step(w):
        return x @ w
    out = x.astype(jnp.float32) @ in_step(x, w)
    return out.astype(jnp.result_type(x.dtype, w.dtype))


def matmul_rows(x: Float[Array, "seq d_in"], w: Float[Array, "d_out d_in"]) -> Float[Array, "seq d_out"]:
    """`x @ w.T`, contracting with the rows of `w` as they lie (no transposed copy, as
    for a tied embedding); converted as in `matmul`."""
    dims = (((1,), (1,)), ((), ()))
    if not converted_in_step(w):
        return jax.lax.dot_general(x, w, dims)
    out = jax.lax.dot_general(x.astype(jnp.float32), in_step(x, w), dims)
    return out.astype(jnp.result_type(x.dtype, w.dtype))


HEAD_CHUNKS = 16  # a low-precision head on the CPU is converted in this many parts


def matmul_vocab(x: Float[Array, "seq d_in"], w: Float[Array, "..."], *, rows: bool) -> Float[Array, "seq vocab"]:
    """The head's product: `matmul(x, w)` for a `(d_model, vocab)` head, or
    `matmul_rows(x, w)` for a `(vocab, d_model)` table (`rows=True`, a tied embedding).

    The vocabulary is the widest axis of a model, and its float32 copy, made at once,
    would be the largest buffer of a decode step (a third of a bfloat16 SmolLM2's
    weights). A low-precision table on the CPU is therefore converted in at most
    `HEAD_CHUNKS` parts of `ceil(vocab / HEAD_CHUNKS)` columns (the last one narrower when
    they do not divide the vocabulary), one part per iteration of a `lax.scan`, so that
    one part's float32 copy is alive at a time; each column is computed as in one
    product. A loop, not a Python `for`: unrolled, the parts were 58 of the 306 kernels
    of a bfloat16 SmolLM2-shape `generate` program, and XLA:CPU's fusion emitters hold
    about 1 MiB per kernel until the program is compiled (docs/kv_cache.md, "What a
    first call's memory is made of"). Anything else takes the one product, unchanged.
    """
    product = matmul_rows if rows else matmul
    axis = 0 if rows else 1
    n = w.shape[axis]
    if not converted_in_step(w) or n < 2 * HEAD_CHUNKS:
        return product(x, w)
    dims = (((1,), (1 if rows else 0,)), ((), ()))
    x32, size = x.astype(jnp.float32), -(-n // HEAD_CHUNKS)
    full = n // size

    def part(start, width):
        # The table goes through a barrier with the part's start: XLA sees a slice of a
        # loop-invariant table, converts the whole table once, ahead of every loop, and
        # holds it in float32; behind the barrier each part is converted in its iteration.
        start, tied = jax.lax.optimization_barrier((start, w))
        return jax.lax.dot_general(x32, in_step(x, jax.lax.dynamic_slice_in_dim(tied, start, width, axis)), dims)

    _, parts = jax.lax.scan(lambda _, i: (None, part(i * size, size)), None, jnp.arange(full))
    outs = [jnp.moveaxis(parts, 0, -2).reshape(*x.shape[:-1], full * size)]
    if full * size < n:
        outs.append(part(full * size, n - full * size))
    return jnp.concatenate(outs, axis=-1).astype(jnp.result_type(x.dtype, w.dtype))


@jax.custom_jvp
def in_step(x: Float[Array, "*x"], w: Float[Array, "*w"]) -> Float[Array, "*w"]:
    """`w` in float32, converted after `x` exists, inside any loop that computes `x`.

    Two ties, because XLA honours each for one purpose only: an optimization barrier
    that holds `w` with `x` keeps the conversion inside the loop (loop-invariant code
    motion does not see through it; the barrier is gone by the time the program is
    scheduled), and a select on a value of `x` that is always true, including for a
    NaN (`not (v > inf)`), orders it after `x`. The select reads `x` as it leaves the
    barrier: with that output unused, XLA dropped `x` from the barrier and hoisted the
    conversion of an unstacked block's `wo` out of the decode loop. The select is made
    on the float32 side, fused with the conversion: one pass that reads `w` and writes
    its float32 copy.

    Under `jax.vmap` over `x` alone the predicate comes from the first row, so `w` is
    not batched (`_in_step_vmap`). The derivative is that of `w.astype(float32)`; `x`
    only orders the computation.
    """
    return _tied(x, w)


@in_step.defjvp
def _in_step_jvp(primals, tangents):
    x, w = primals
    _, w_dot = tangents
    return in_step(x, w), w_dot.astype(jnp.float32)


@custom_vmap
def _tied(x, w):
    return _convert_after(x, w)


@_tied.def_vmap
def _in_step_vmap(axis_size, in_batched, x, w):
    x_batched, w_batched = in_batched
    if x_batched:
        x = x[0]
    if w_batched:
        return jax.vmap(_convert_after, in_axes=(None, 0))(x, w), True
    return _tied(x, w), False


def _convert_after(x, w):
    x, w = jax.lax.optimization_barrier((x, w))
    keep = ~(x.reshape(-1)[0].astype(jnp.float32) > jnp.inf)
    return jnp.where(keep, w.astype(jnp.float32), jnp.float32(0))
