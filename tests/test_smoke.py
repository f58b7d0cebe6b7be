import equinox as eqx
import jax
import jax.numpy as jnp

import eqrope


def test_seed_model_runs_and_matches_cache():
    model = eqrope.RotaryDecoder(65, 64, 4, 2, 256, key=jax.random.PRNGKey(0))
    ids = jnp.arange(8, dtype=jnp.int32)
    full = model(ids)
    cache = model.init_cache()
    step = eqx.filter_jit(lambda m, token, c, t: m.step(token, c, t))  # compiled once
    for t in range(8):
        last, cache = step(model, ids[t], cache, jnp.int32(t))
    assert float(jnp.max(jnp.abs(last - full[-1]))) < 1e-5
