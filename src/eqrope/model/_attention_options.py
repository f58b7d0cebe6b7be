"""The attention variants of the open checkpoint families, as one small frozen record."""

import dataclasses

from .._checks import check_bool, check_int
from .._custom_types import IntLike


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
    """How each block's attention differs from the seed's, one field per variant.

    The defaults are the seed's (and Llama's) attention. The open families set:

    | family | options |
    |---|---|
    | Llama 2/3.x, SmolLM, TinyLlama | none (`head_dim` where the config gives it) |
    | Mistral | `window` |
    | Qwen2 / Qwen2.5 | `qkv_bias=True`; `window` and `window_blocks` when the config turns the window on |
    | Qwen3 | `qk_norm=True`, `head_dim` (128 whatever the width) |

    **Arguments:**

    - `head_dim`: the width of each head; `None` means `d_model // n_heads`. Queries, keys
      and values have `n_heads * head_dim` (or `n_kv_heads * head_dim`) columns, which
      need not equal `d_model` (Qwen3).
    - `qkv_bias`: biases on the query, key and value projections (Qwen2).
    - `out_bias`: a bias on the output projection. (`DecoderConfig.bias=True` puts biases
      on every projection, these two included.)
    - `qk_norm`: an RMSNorm over `head_dim` on each query and key head, with its own
      weight of `head_dim` entries, before the rotation (Qwen3). It uses the model's
      `norm_eps`.
    - `window`: sliding-window attention (Mistral; Beltagy et al. 2020): the query at
      position `p` sees the positions `p - window + 1 .. p`, as transformers'
      `sliding_window`. `None`: every earlier position.
    - `window_blocks`: the indices of the blocks that use the window; `None` means every
      block. Qwen2's `max_window_layers = m` is `window_blocks = (m, ..., n_blocks - 1)`.
      A list is stored as a tuple.
    """

    head_dim: IntLike | None = None
    qkv_bias: bool = False
    out_bias: bool = False
    qk_norm: bool = False
    window: IntLike | None = None
    window_blocks: tuple[IntLike, ...] | list[IntLike] | None = None

    def __post_init__(self):
        for name in ("head_dim", "window"):
            value = check_int(getattr(self, name), f"AttentionOptions.{name}", minimum=1, none=True)
            object.__setattr__(self, name, value)
        for name in ("qkv_bias", "out_bias", "qk_norm"):
            object.__setattr__(self, name, check_bool(getattr(self, name), f"AttentionOptions.{name}"))
        blocks = self.window_blocks
        if blocks is not None:
            if isinstance(blocks, (str, bytes)) or not hasattr(blocks, "__iter__"):
                raise TypeError(
                    f"AttentionOptions.window_blocks must be a sequence of block indices or "
                    f"None, got {blocks!r}."
                )
            blocks = tuple(
                check_int(b, "AttentionOptions.window_blocks[i]", minimum=0) for b in blocks
            )
            if list(blocks) != sorted(set(blocks)):
                raise ValueError(
                    f"AttentionOptions.window_blocks must list distinct block indices in "
                    f"increasing order, got {blocks}."
                )
            if self.window is None:
                raise ValueError(
                    "AttentionOptions.window_blocks is set but window is None; set window "
                    "(the number of positions each query sees) or leave window_blocks None."
                )
            object.__setattr__(self, "window_blocks", blocks)

    def windowed(self, n_blocks: int) -> tuple[bool, ...]:
        """Whether each of `n_blocks` blocks uses the sliding window."""
        if self.window is None:
            return (False,) * n_blocks
        if self.window_blocks is None:
            return (True,) * n_blocks
        return tuple(i in self.window_blocks for i in range(n_blocks))
