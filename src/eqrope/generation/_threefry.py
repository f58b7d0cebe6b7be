"""The sampled draw, `jax.random.categorical(jax.random.fold_in(key, position), logits)`,
bit for bit, through threefry's unrolled hash.

On CPU JAX lowers its `threefry2x32` primitive as a rolled five-iteration loop: a
`while` of some thirty thunks per hash, which XLA:CPU compiles one by one, and a sampled
step hashes twice (the `fold_in` and the Gumbel noise). On GPU and TPU JAX lowers the same
primitive unrolled, straight-line integer arithmetic that fuses into the kernels around
it. `draw_token` computes the same bits as JAX's functions, with JAX's own hash function
called unrolled in the traced program, for threefry keys (typed, or raw `uint32[2]` data
read with the default implementation), with partitionable threefry (JAX's default) and
the low dynamic-range Gumbel noise (JAX's default) on float32 logits. Anything else
(rbg keys, other settings or dtypes, a JAX whose internals moved) draws with
`jax.random` itself. The noise is a kernel of its own (see `draw_token`), vectorized,
which makes a sampled step faster too.

The layout replicated (jax/_src/random/threefry2x32.py, core.py):

- `fold_in(key, d)`: the hash of the counter pair `(0, d)` under `key`, as the new key.
- `bits(key, (n,))` (32 bits, partitionable): the hashes `(h1, h2)` of the counters
  `(0, i)`, `i < n`, as `h1 ^ h2`.
- `uniform(key, (n,), float32, tiny, 1)`: the top 23 bits as a mantissa in `[1, 2)`,
  less 1, scaled to `[tiny, 1)`; `gumbel` (low mode): `-log(-log(u))`;
  `categorical`: the argmax of the noise plus the logits.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, Key, UInt

try:  # JAX's own hash; a JAX that moved it draws with `jax.random`.
    from jax._src.random.threefry2x32 import _threefry2x32_lowering
except (ImportError, AttributeError):  # pragma: no cover - depends on the JAX version
    _threefry2x32_lowering = None

_IMPL = "threefry2x32"


def draw_token(
    key: UInt[Array, "2"] | Key[Array, ""], position: Int[Array, ""], logits: Float[Array, " vocab"]
) -> Int[Array, ""]:
    """`jax.random.categorical(jax.random.fold_in(key, position), logits)`, bit for bit."""
    data = threefry_data(key)
    if data is None or logits.dtype != jnp.float32:
        return jax.random.categorical(jax.random.fold_in(key, position), logits)
    data = fold_in(data, position)
    # The noise is computed in a loop of one trip whose count XLA cannot know (positions
    # are never negative; a second trip would compute the same noise again): so it is a
    # kernel of its own, vectorized, instead of being inlined into the argmax's scalar
    # reduction (a sampled step 1 ms faster at a vocabulary of 49152 on CPU). XLA fuses
    # the key's hash into it, once per entry but vectorized: no slower, one kernel less.
    trips = 1 + (jnp.asarray(position) < 0).astype(jnp.int32)
    noise = jax.lax.fori_loop(
        0, trips, lambda _, __: gumbel(data, logits.shape[0]), jnp.zeros(logits.shape, jnp.float32)
    )
    return jnp.argmax(noise + logits, axis=-1)


def threefry_data(key: UInt[Array, "2"] | Key[Array, ""]) -> UInt[Array, "2"] | None:
    """The `uint32[2]` data of a threefry `key` whose draws this module reproduces, or
    `None` for one it does not: another implementation, or settings other than JAX's
    defaults (partitionable threefry, low dynamic-range Gumbel noise)."""
    if _threefry2x32_lowering is None or not jax_defaults() or str(jax.random.key_impl(key)) != _IMPL:
        return None
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(key)
    return jnp.asarray(key)


def jax_defaults() -> bool:
    """Whether JAX draws with partitionable threefry and low dynamic-range Gumbel noise,
    the layout this module replicates (`False` for a JAX that renamed the settings)."""
    try:
        return bool(jax.config.jax_threefry_partitionable) and not jax.config.jax_high_dynamic_range_gumbel
    except AttributeError:  # pragma: no cover - depends on the JAX version
        return False


def hash_pairs(
    data: UInt[Array, "2"], high: UInt[Array, "*n"], low: UInt[Array, "*n"]
) -> tuple[UInt[Array, "*n"], UInt[Array, "*n"]]:
    """Threefry-2x32 of the counter pairs `(high, low)` under the key `data`: JAX's hash,
    unrolled."""
    assert _threefry2x32_lowering is not None
    return _threefry2x32_lowering(data[0], data[1], high, low, use_rolled_loops=False)


def fold_in(data: UInt[Array, "2"], value: Int[Array, ""]) -> UInt[Array, "2"]:
    """`jax.random.key_data(jax.random.fold_in(key, value))` from `key`'s data."""
    value = jnp.asarray(value).astype(jnp.uint32)
    first, second = hash_pairs(data, jnp.zeros((), jnp.uint32), value)
    return jnp.stack([first, second])


def bits(data: UInt[Array, "2"], n: int) -> UInt[Array, " n"]:
    """`jax.random.bits(key, (n,))` (32-bit) from `key`'s data."""
    first, second = hash_pairs(data, jnp.zeros((n,), jnp.uint32), jax.lax.iota(jnp.uint32, n))
    return first ^ second


def gumbel(data: UInt[Array, "2"], n: int) -> Float[Array, " n"]:
    """`jax.random.gumbel(key, (n,), jnp.float32)` (low mode) from `key`'s data."""
    tiny = jnp.float32(np.finfo(np.float32).tiny)
    one = jnp.float32(1.0)
    mantissa = jax.lax.shift_right_logical(bits(data, n), jnp.uint32(32 - 23))
    mantissa = mantissa | jnp.uint32(np.array(1.0, np.float32).view(np.uint32))
    floats = jax.lax.bitcast_convert_type(mantissa, jnp.float32) - one
    uniform = jax.lax.max(tiny, floats * (one - tiny) + tiny)
    return -jnp.log(-jnp.log(uniform))


def categorical(data: UInt[Array, "2"], logits: Float[Array, " vocab"]) -> Int[Array, ""]:
    """`jax.random.categorical(key, logits)` for float32 logits from `key`'s data."""
    return jnp.argmax(gumbel(data, logits.shape[0]) + logits, axis=-1)
