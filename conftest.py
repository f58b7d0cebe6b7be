"""Settings for the whole test session (tests/ and the executable docs/)."""

import jax


# Mixed-dtype arithmetic must be explicit in eqrope: any implicit promotion is an error.
jax.config.update("jax_numpy_dtype_promotion", "strict")
