"""`PagedCache`: the engine's key/value pool, pages shared by every slot, read through page tables.

Each block has its own pool, `(kv_heads, pages, page_size, head_dim)`: the layout of JAX's
Pallas paged-attention kernels (`jax.experimental.pallas.ops.{gpu,tpu}.paged_attention`
take `k_pages, v_pages` so, one block at a time). Page 0 is the null page: writes for
rows that hold nothing (a finished slot, a prompt's padding) go there and it is never
read unmasked. Which pages a sequence holds is the host's business (`_pages.PagePool`);
here the table is an array argument.

The model reads the pool through its ordinary cache protocol (`view`): a view that
[`eqrope.RotaryDecoder.forward`][] walks block by block, each block's rows found through
the table ([`eqrope.model.BlockCache`] with a `table`), so attention itself is the model's
own, masked by positions: rows at or past a sequence's position are never seen.
"""

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from ..model import DecoderConfig
from ..model._block_cache import BlockCache


Pool = tuple[Float[Array, "kv_heads pages page_size head_dim"], ...]


class PagedView(eqx.Module):
    """One sequence's view of the pool (its page table), in the model's cache protocol:
    `per_block` and `block(index, bound, low)`, which the unstacked blocks read."""

    keys: Pool
    values: Pool
    table: Int[Array, " max_pages"]
    chunk: int = eqx.field(static=True)
    per_block = True

    def block(self, index: int, bound=None, low=None) -> BlockCache:
        return BlockCache(
            self.keys[index], self.values[index], None, None, None, bound, low, self.chunk, self.table
        )


class PagedCache(eqx.Module):
    """The pool of pages of every block: `keys[b]`, `values[b]` are block `b`'s pages."""

    keys: Pool
    values: Pool

    @classmethod
    def empty(cls, config: DecoderConfig, pages: int, page_size: int) -> "PagedCache":
        """A zeroed pool of `pages` pages (page 0, the null page, included) of
        `page_size` rows, in the model's dtype."""
        shape = (config.n_kv_heads, pages, page_size, config.head_dim)
        make = lambda: tuple(jnp.zeros(shape, config.jnp_dtype) for _ in range(config.n_blocks))
        return cls(make(), make())

    @property
    def pages(self) -> int:
        return self.keys[0].shape[1]

    @property
    def page_size(self) -> int:
        return self.keys[0].shape[2]

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in (*self.keys, *self.values))

    def bytes_per_page(self) -> int:
        return self.nbytes // self.pages

    def view(self, table: Int[Array, " max_pages"], chunk: int) -> PagedView:
        """The cache of the sequence whose pages are `table`, read `chunk` rows at a time
        (a multiple of the page size)."""
        return PagedView(self.keys, self.values, table, chunk)

    def write(
        self,
        keys: Float[Array, "blocks kv_heads rows head_dim"],
        values: Float[Array, "blocks kv_heads rows head_dim"],
        pages: Int[Array, " rows"],
        offsets: Int[Array, " rows"],
    ) -> "PagedCache":
        """Each block's new `rows`, row `i` to row `offsets[i]` of page `pages[i]` (page 0
        for rows that hold nothing). Rows of one call never share a (page, offset) but on
        the null page."""

        def put(pool, new):
            return tuple(p.at[:, pages, offsets, :].set(n.astype(p.dtype)) for p, n in zip(pool, new))

        return PagedCache(put(self.keys, keys), put(self.values, values))

    def copy_pages(self, sources: Int[Array, " n"], targets: Int[Array, " n"]) -> "PagedCache":
        """Page `targets[i]` becomes a copy of page `sources[i]` (a sample's own copy of its
        prompt's partial last page)."""
        copy = lambda pool: tuple(p.at[:, targets].set(p[:, sources]) for p in pool)
        return PagedCache(copy(self.keys), copy(self.values))


def page_rows(
    table: Int[Array, "slots max_pages"], positions: Int[Array, "slots *rows"], live, page_size: int
) -> tuple[Int[Array, "slots *rows"], Int[Array, "slots *rows"]]:
    """Where row `positions` of each sequence lives: `(page, offset)`; the null page for
    rows that are not `live`."""
    index = jnp.clip(positions // page_size, 0, table.shape[-1] - 1)
    flat = index.reshape(*table.shape[:-1], -1)  # each table's positions on its last axis
    page = jnp.take_along_axis(table, flat, axis=-1).reshape(positions.shape)
    return jnp.where(live, page, 0), jnp.where(live, positions % page_size, 0)


def pool_pages(budget_bytes: int, config: DecoderConfig, page_size: int) -> int:
    """How many pages of `page_size` rows fit in `budget_bytes` of keys and values."""
    itemsize = np.dtype(config.jnp_dtype).itemsize
    per_page = 2 * config.n_blocks * config.n_kv_heads * page_size * config.head_dim * itemsize
    return budget_bytes // per_page
