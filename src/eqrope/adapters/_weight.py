"""Low-rank adapters (LoRA): a frozen weight plus `scale * A @ B` on chosen projections.

Hu et al. (2021): a linear map `x W` is adapted as `x W + scale * (x A) B`, with `A`
`(d_in, rank)` and `B` `(rank, d_out)`, `B` starting at zero so that a new adapter changes
nothing; only `A` and `B` are trained. `scale = alpha / rank`, or `alpha / sqrt(rank)`
with rsLoRA (Kalajdzievski 2023), as PEFT computes it.

An adapted model is the same [`eqrope.RotaryDecoder`][] with each adapted weight array
replaced by a [`eqrope.LoraWeight`][]: an `eqx.Module` that holds the frozen array and
the low-rank factors, and that the layers' own `x @ W` calls (`__rmatmul__`). So the
adapted model has the decoder's call, cache protocol, two layouts and `generate`
unchanged, and the update runs as two thin matrix products, never as a merged `d x d`
matrix. eqrope fuses q/k/v (`wqkv`) and gate/up (`w_gate_up`); each fused part has its own
factors, and a part without an adapter gets no update, so an adapter on `q` alone changes
only q's columns.

The targets are named after PEFT's `target_modules` without `_proj`, and read from the
weight table (`eqrope.weights._table`): one row per Hugging Face projection.

??? cite "Reference"

    Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", Eq. (3);
    Kalajdzievski 2023, "A Rank Stabilization Scaling Factor for Fine-Tuning with LoRA".
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap
from jaxtyping import Array, Float, Int, Key, PRNGKeyArray

from ..model._matmul import matmul


class LowRank(eqx.Module):
    """One target's update `scale * (x A) B` (Hu et al. 2021, Eq. 3).

    **Fields:** `a (d_in, rank)` and `b (rank, d_part)`, with leading axes where the
    blocks are stacked (`blocks`) or adapters stacked (`adapters`); `alpha`, `rslora`
    (`scale = alpha / rank`, or `alpha / sqrt(rank)` with rsLoRA) and `dropout` (on the
    input of `A` while training, as PEFT's `lora_dropout`), static.
    """

    a: Float[Array, "*lead d_in rank"]
    b: Float[Array, "*lead rank d_part"]
    alpha: float = eqx.field(static=True)
    rslora: bool = eqx.field(static=True)
    dropout: float = eqx.field(static=True)

    @property
    def rank(self) -> int:
        return self.a.shape[-1]

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    def delta(self, x: Float[Array, "*seq d_in"], key: PRNGKeyArray | None = None) -> Float[Array, "*seq d_part"]:
        """`scale * (dropout(x) A) B`, dropout drawn from `key` (none without one)."""
        if key is not None and self.dropout > 0:
            keep = jax.random.bernoulli(key, 1.0 - self.dropout, x.shape)
            x = jnp.where(keep, x / (1.0 - self.dropout), jnp.zeros((), x.dtype))
        return (x @ self.a) @ self.b * self.scale

    def product(self) -> Float[Array, "*lead d_in d_part"]:
        """`scale * A @ B`, the dense update (for merging)."""
        return (self.a @ self.b) * self.scale


class LoraWeight(eqx.Module):
    """A frozen weight with low-rank updates on some of its fused parts.

    It stands where the decoder holds a weight array (`wqkv`, `wo`, `w_gate_up`,
    `w_down`), and the layer's `x @ W` calls `__rmatmul__`: `x @ weight + (x A) B`, with
    every part's factors joined into one pair (`factors`), zero on the columns of parts
    without an adapter. Built by [`eqrope.lora`][].

    **Fields:** `weight (d_in, d_out)` (the frozen base array, with a leading `blocks`
    axis where the blocks are stacked); `parts`, one [`eqrope.LowRank`][] or `None` per
    fused part; `rows`, `None` or each batch row's adapter (see
    [`eqrope.select_adapters`][]); `key`, `None` or the dropout key a train step sets;
    `widths` and `names` (each part's columns and target name) and `path` (the table
    row, `"blocks.attn.wqkv"`), static.
    """

    weight: Float[Array, "*blocks d_in d_out"]
    parts: tuple[LowRank | None, ...]
    rows: Int[Array, "*blocks batch"] | None
    key: Key[Array, "*blocks"] | None
    widths: tuple[int, ...] = eqx.field(static=True)
    names: tuple[str, ...] = eqx.field(static=True)
    path: str = eqx.field(static=True)

    @property
    def dtype(self):
        return self.weight.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.weight.shape

    def __rmatmul__(self, x: Float[Array, "*seq d_in"]) -> Float[Array, "*seq d_out"]:
        if self.weight.ndim != 2:
            raise ValueError(
                f"LoraWeight {self.path} holds stacked blocks (weight shape "
                f"{self.weight.shape}); it is applied block by block, inside the model."
            )
        out = matmul(x, self.weight)  # the unadapted layer's own product, bit for bit
        if self.key is not None and any(p is not None and p.dropout > 0 for p in self.parts):
            # Training with dropout: each part draws its own mask, as PEFT's modules do.
            deltas = [
                jnp.zeros((*x.shape[:-1], w), out.dtype) if p is None
                else p.delta(x, jax.random.fold_in(self.key, j)).astype(out.dtype)
                for j, (p, w) in enumerate(zip(self.parts, self.widths))
            ]  # fmt: skip
            return out + (deltas[0] if len(deltas) == 1 else jnp.concatenate(deltas, axis=-1))
        a, b = self.factors()
        if self.rows is not None:
            return out + _per_row(x, a, b, self.rows).astype(out.dtype)
        if a.ndim != 2:
            raise ValueError(
                f"the adapters on {self.path} are {a.shape[0]} stacked adapters (A of shape "
                f"{a.shape}); choose one per row with eqrope.select_adapters, one for all "
                "with eqrope.take_adapter, or map over them with "
                "eqx.filter_vmap(..., in_axes=eqrope.adapter_axes(model))."
            )
        return out + ((x @ a) @ b).astype(out.dtype)

    def factors(self, dtype=None) -> tuple[Float[Array, "*lead d_in total_rank"], Float[Array, "*lead total_rank d_out"]]:
        """Every part's update as one pair: the parts' `A` side by side, and their `B`,
        times their scales, each in its own rows and its own part's columns (zero
        elsewhere), so that `(x A) B` is every update at once, two matrix products
        whatever the number of parts. They depend on the weights alone, so inside a
        decode loop XLA computes them once, before the loop. `dtype`: cast first."""
        a, b, start, d_out = [], [], 0, sum(self.widths)
        for p, width in zip(self.parts, self.widths):
            if p is not None:
                pa, pb = (p.a, p.b) if dtype is None else (p.a.astype(dtype), p.b.astype(dtype))
                a.append(pa)
                scaled = pb * jnp.asarray(p.scale, pb.dtype)
                b.append(jnp.pad(scaled, [(0, 0)] * (pb.ndim - 1) + [(start, d_out - start - width)]))
            start += width
        join = lambda xs, axis: xs[0] if len(xs) == 1 else jnp.concatenate(xs, axis)  # noqa: E731
        return join(a, -1), join(b, -2)

    @property
    def fixed_rows(self) -> int | None:
        """The rows this weight's model must run on (`jax.vmap` over exactly that many),
        `len(adapter_ids)` after [`eqrope.select_adapters`][]; `None` for any number."""
        return None if self.rows is None else self.rows.shape[-1]

    @property
    def sum_dtype(self):
        """The dtype merging sums in: float32, or the weight's own if wider (float64)."""
        dtype = jnp.dtype(self.weight.dtype)
        return dtype if dtype.itemsize > 4 else jnp.dtype(jnp.float32)

    def delta(self) -> Float[Array, "*blocks d_in d_out"]:
        """The dense update of the whole weight in `sum_dtype`, zero on parts without an
        adapter."""
        if self.rows is not None:
            raise ValueError(
                f"LoraWeight {self.path} holds several adapters chosen per row; take one "
                "with eqrope.take_adapter before merging."
            )
        a, b = self.factors(self.sum_dtype)
        return a @ b

    def merged(self) -> Float[Array, "*blocks d_in d_out"]:
        """`weight + delta()`, summed in `sum_dtype` and cast back to the weight's dtype."""
        return (self.weight.astype(self.sum_dtype) + self.delta()).astype(self.weight.dtype)

    def unmerged(self, merged: Float[Array, "*blocks d_in d_out"]) -> "LoraWeight":
        """This weight over the base `merged - delta()` (summed in `sum_dtype`)."""
        base = (merged.astype(self.sum_dtype) - self.delta()).astype(merged.dtype)
        return eqx.tree_at(lambda w: w.weight, self, base)


def is_lora(x) -> bool:
    return isinstance(x, LoraWeight)


def lora_weights(model) -> list[LoraWeight]:
    """Every `LoraWeight` of `model`, in pytree order."""
    return [x for x in jax.tree.leaves(model, is_leaf=is_lora) if is_lora(x)]


# -- rows that each use their own adapter ---------------------------------------------------


@custom_vmap
def _per_row(x, a, b, rows):
    """`(x a[rows[0]]) b[rows[0]]` for one row; under `jax.vmap` over `len(rows)` rows,
    row `i` uses `a[rows[i]]`, `b[rows[i]]` (the batching rule below). The model is closed
    over by `generate`'s `jax.vmap` over rows, so a row's adapter cannot come in as a
    mapped argument; this rule gathers it instead.

    The one-row function is also what `lax.scan` traces before batching its body, so it
    cannot refuse at trace time; a call on one row of a model chosen for several raises
    when it runs."""
    if rows.shape[0] != 1:
        x = eqx.error_if(
            x,
            rows[0] >= 0,
            f"a model whose adapters are chosen per row (eqrope.select_adapters, "
            f"{rows.shape[0]} rows) runs under jax.vmap over its rows, as eqrope.generate "
            "runs it; it was called on one row.",
        )
    return (x @ a[rows[0]]) @ b[rows[0]]


@_per_row.def_vmap
def _per_row_batched(axis_size, in_batched, x, a, b, rows):
    x_batched, *rest = in_batched
    if any(rest):
        raise ValueError(
            "the stacked adapters or the row assignment of a model from "
            "eqrope.select_adapters are being mapped by jax.vmap; map only the inputs."
        )
    if rows.shape[0] != axis_size:
        raise ValueError(
            f"the model's adapters are chosen for {rows.shape[0]} rows "
            f"(eqrope.select_adapters), but jax.vmap runs it over {axis_size}; pass one "
            "adapter id per row of the batch. num_samples (whose prefill and decode have "
            "different numbers of rows) does not run with adapters chosen per row: repeat "
            "the prompts instead."
        )
    if not x_batched:
        x = jnp.broadcast_to(x, (axis_size, *x.shape))
    h = jnp.einsum("b...i,bir->b...r", x, a[rows])
    return jnp.einsum("b...r,bro->b...o", h, b[rows]), True


# -- adapting, merging ----------------------------------------------------------------------
