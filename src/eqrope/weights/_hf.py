"""Hugging Face Llama checkpoints in and out, with numpy and safetensors only (no torch).

eqrope's default decoder is the Llama architecture (RMSNorm, SwiGLU, rotary positions,
no biases) up to two details, both handled here:

- **The rotary pairing.** Hugging Face rotates dimension `i` of a head together with
  dimension `i + head_dim/2` ("rotate-half", GPT-NeoX layout); eqrope rotates `2i` with
  `2i + 1` (RoFormer Eq. 15, as in gpt-fast and llama2.c). Both rotate pair `i` by the
  same angle `pos * theta_i`, so permuting the rows of the query and key projections of
  every head, `ours[2i] = hf[i]`, `ours[2i + 1] = hf[i + head_dim/2]`, gives the same
  rotated vectors up to that permutation, and dot products of queries with keys, which
  sum over all dimensions, are unchanged. Values are not rotated and not permuted.
- **The head bias.** Llama has none: imported models get `head_bias=False`, and export
  refuses a non-zero head bias unless told to drop it.

Hugging Face stores `nn.Linear` weights as `(out, in)`; eqrope stores `x @ W` weights as
`(in, out)`, fuses q/k/v into `wqkv` and gate/up into `w_gate_up`, and stacks the blocks
on a leading axis. The table in `_weights.py` says, array by array, which Hugging Face
tensors it comes from and how.
"""

import numpy as np


CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def pairing_permutation(n_heads: int, head_dim: int) -> np.ndarray:
    """Row order that turns rotate-half projection rows into interleaved ones.

    `ours = hf[perm]` over the `n_heads * head_dim` output rows of a query or key
    projection: within each head, `ours[2i] = hf[i]` and `ours[2i + 1] = hf[i + head_dim/2]`.
    `np.argsort(perm)` is the inverse (export).
    """
    half = head_dim // 2
    within = np.stack([np.arange(half), np.arange(half) + half], axis=1).reshape(-1)
    return (np.arange(n_heads)[:, None] * head_dim + within[None, :]).reshape(-1)
