import jax
import jax.numpy as jnp

import eqrope


def test_seed_model_runs_and_matches_cache():
    model = eqrope.RotaryDecoder(65, 64, 4, 2, 256, key=jax.random.PRNGKey(0))
    ids = jnp.arange(8, dtype=jnp.int32)
    full = model(ids)
    cache = model.init_cache()
    for t in range(8):
        last, cache = model.step(ids[t], cache, t)
    assert float(jnp.max(jnp.abs(last - full[-1]))) < 1e-5
