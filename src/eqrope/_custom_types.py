"""Named type aliases of eqrope's signatures, in one place (as Lineax and Diffrax keep theirs).

- `IntLike`: what an integer argument takes: a Python or NumPy integer, or a 0-d integer
  array (NumPy, or JAX outside a trace). Its check, `_checks.check_int`, refuses a bool
  and returns a Python `int`.
- `RealLike`: what a real-number argument takes: the same, and floats
  (`_checks.check_float` returns a Python `float`).
- `PerRow`: a setting of `generate` given per row of a batch: a list or tuple of the
  rows' values, or a `(batch,)` array (its check, `generation._per_row.split_rows`,
  refuses any other shape by name).
"""

import jax
import numpy as np
from jaxtyping import Int, Real


IntLike = int | np.integer | Int[np.ndarray, ""] | Int[jax.Array, ""]
RealLike = float | int | np.integer | np.floating | Real[np.ndarray, ""] | Real[jax.Array, ""]
PerRow = list | tuple | np.ndarray | jax.Array
