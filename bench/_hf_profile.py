"""bench/vs_transformers.py --profile: where one decode step's time goes, on each side.

Needs torch and transformers (the `[hf]` extra); imported by bench/vs_transformers.py
after it has checked that they are installed.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import torch

from _bounds import weight_matrices
from _timing import time_call


def profile_step(model, hf_model, prompt_len: int, n: int) -> dict:
    """Where one decode step's time goes, on each side.

    - eqrope: `model.step` compiled (`eqx.filter_jit`) at position `prompt_len + n/2`, and,
      for comparison, one compiled function doing only the step's weight products: a
      `(1, in) @ (in, out)` product with every weight matrix (each block's `wqkv`, `wo`,
      `w_gate_up`, `w_down`, and the head).
    - The same weight products in torch, on the same threads.
    - transformers: one forward of one token against a cache of `prompt_len + n/2` rows,
      and the torch ops that take its time (torch.profiler).
    """
    cache = model.init_cache()
    step = eqx.filter_jit(lambda m, t, c, p: m.step(t, c, p, check=False))
    token = jnp.asarray(1, jnp.int32)
    pos = jnp.asarray(prompt_len + n // 2, jnp.int32)
    ours = time_call(lambda: step(model, token, cache, pos), repeats=50, warmup=2)

    matrices = weight_matrices(model)
    nbytes = sum(int(w.size) * w.dtype.itemsize for w in matrices)

    @jax.jit
    def products(matrices):
        return [jnp.ones((1, w.shape[0]), w.dtype) @ w for w in matrices]

    xla = time_call(lambda: products(matrices), repeats=50, warmup=2)
    torch_matrices = [torch.from_numpy(np.array(w)) for w in matrices]
    ones = {w.shape[0]: torch.ones(1, w.shape[0]) for w in torch_matrices}
    with torch.inference_mode():
        torch_products = time_call(
            lambda: [ones[w.shape[0]] @ w for w in torch_matrices], repeats=50, warmup=2
        )
        ids = torch.randint(0, model.config.vocab_size, (1, prompt_len + n // 2))
        past = hf_model(ids, use_cache=True).past_key_values
        one = torch.tensor([[1]])

        def hf_step():
            return hf_model(one, past_key_values=past, use_cache=True).logits

        # The DynamicCache grows by one row per call; 50 rows on a cache of hundreds is noise.
        theirs = time_call(hf_step, repeats=50, warmup=2)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(20):
                hf_step()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    return {
        "position": int(pos),
        "eqrope_step_median_s": ours["median_s"],
        "weight_bytes": nbytes,
        "xla_weight_products_median_s": xla["median_s"],
        "torch_weight_products_median_s": torch_products["median_s"],
        "hf_forward_one_token_median_s": theirs["median_s"],
        "hf_top_ops": table,
    }
