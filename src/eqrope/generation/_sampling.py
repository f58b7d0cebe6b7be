"""Choosing the next token from logits, with every setting a traced value."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int, Key, UInt

from ._processors import History, needs_sort, penalize, suppress, truncate
from ._stop_strings import NO_TEXT_STOPS, TextStops
from ._stopping import stop_table


class Sampling(NamedTuple):
    """The sampling and stopping settings of one `generate` call, as arrays.

    They are arguments of the compiled program, not constants, so changing any of them
    never recompiles; only the size buckets of `eos` and `bad` and the shapes of `stop`
    and `stop_text` are part of the program's shape. [`eqrope.generate`][] builds this record after checking
    its arguments (`eqrope.generation._request`). It is a `NamedTuple` (a pytree), not an
    `eqx.Module`: it is built on every call, and a Module's construction costs tens of
    microseconds, a visible part of a small model's generation.

    - `temperature`: 0 is greedy.
    - `top_k`: keep the logits `>=` the k-th largest (`top_k >= vocab` keeps everything).
    - `top_p`: nucleus mass (1 keeps everything).
    - `eos`: the end-of-sequence ids, `(n_eos,)`, padded with -1 as `bad` is.
    - `min_p`: the min-p fraction (0 keeps everything).
    - `repetition_penalty`, `presence_penalty`, `frequency_penalty`: 1, 0, 0 for none.
    - `min_new`: EOS ids are masked, and stop sequences ignored, until a row has this
      many new tokens.
    - `bad`: ids never produced, `(n_bad,)`, padded with -1.
    - `stop`: stop sequences, `(n_stop, stop_len)`, right-aligned, padded on the left with
      -2 (matches anything), spare rows -1 (see `_stopping.py`); no rows for none.
    - `stop_text`: stop strings, matched on the text (see `_stop_strings.py`); a table of
      no strings for none.
    """

    temperature: Float[ArrayLike, ""]
    top_k: Int[ArrayLike, ""]
    top_p: Float[ArrayLike, ""]
    eos: Int[ArrayLike, " n_eos"]
    min_p: Float[ArrayLike, ""] = np.float32(0.0)
    repetition_penalty: Float[ArrayLike, ""] = np.float32(1.0)
    presence_penalty: Float[ArrayLike, ""] = np.float32(0.0)
    frequency_penalty: Float[ArrayLike, ""] = np.float32(0.0)
    min_new: Int[ArrayLike, ""] = np.int32(0)
    bad: Int[ArrayLike, " n_bad"] = np.full((8,), -1, np.int32)
    stop: Int[ArrayLike, "n_stop stop_len"] = stop_table(None)
    stop_text: TextStops = NO_TEXT_STOPS


def penalties_on(sampling: Sampling) -> Bool[Array, "*rows"]:
    """Whether any penalty of the call changes a logit (a setting, the same for every row;
    for settings per row, each row's)."""
    return (
        (jnp.asarray(sampling.repetition_penalty) != 1)
        | (jnp.asarray(sampling.presence_penalty) != 0)
        | (jnp.asarray(sampling.frequency_penalty) != 0)
    )


def masks_on(sampling: Sampling) -> Bool[Array, ""]:
    """Whether the call bans ids or holds EOS back (`bad`, `min_new`)."""
    return jnp.any(jnp.asarray(sampling.bad) >= 0) | (jnp.asarray(sampling.min_new) > 0)


def process_logits(
    logits: Float[Array, " vocab"], history: History, n_new: Int[ArrayLike, ""], sampling: Sampling
) -> Float[Array, " vocab"]:
    """The processors before the temperature: penalties, then `bad` and `min_new` masks.

    They run in one `lax.cond` on the call's settings, whose predicate is the same for
    every row (so it stays a branch under `jax.vmap`): a call without penalties or masks
    skips their work at every step, and no setting recompiles. A call with only one of
    the two runs both: each processor with its neutral settings returns its input bit
    for bit (see `_processors.py`).
    """

    def processed(logits):
        logits = penalize(
            logits,
            history,
            sampling.repetition_penalty,
            sampling.presence_penalty,
            sampling.frequency_penalty,
        )
        return suppress(logits, n_new, sampling.bad, sampling.eos, sampling.min_new)

    return jax.lax.cond(penalties_on(sampling) | masks_on(sampling), processed, lambda x: x, logits)


def per_row(sampling: Sampling) -> bool:
    """Whether `sampling` holds each row's settings (every field with a leading rows axis,
    `stack_rows`) rather than one setting for every row: a static fact (the fields'
    ranks), so the two are different programs."""
    return np.ndim(sampling.temperature) == 1


def stack_rows(rows: list[Sampling]) -> Sampling:
    """The settings of each row: each field of `rows` stacked on a leading axis, as
    `choose_rows` and `commit` take them (a `generate` call's rows, the engine's slots)."""
    return jax.tree.map(lambda *fields: np.stack([np.asarray(f) for f in fields]), *rows)


def choose_token(
    logits: Float[Array, " vocab"],
    history: History,
    n_new: Int[Array, ""],
    key: UInt[Array, "2"] | Key[Array, ""],
    position: Int[Array, ""],
    sampling: Sampling,
    sorts: Bool[ArrayLike, ""] | None = None,
) -> tuple[Int[Array, ""], Float[Array, ""], Float[Array, ""]]:
    """The token at `position` of a row: every processor, then `sample_token` (`sorts`:
    see `_processors.truncate`).

    **Returns:** `(token, logprob, model_logprob)`: the token; its log-probability under
    the distribution it was drawn from (after every processor: penalties, masks,
    temperature and truncation; greedy decoding has no temperature or truncation); and
    its log-probability under the model's own distribution at the sampling temperature
    (`log_softmax(logits / temperature)`, temperature 1 when greedy), without penalties,
    masks or truncation.
    """
    logits = logits.astype(jnp.float32)
    processed = process_logits(logits, history, n_new, sampling)
    token, logprob = sample_token(processed, key, position, sampling, sorts)
    return token, logprob, model_logprob(logits, token, sampling)


def choose_rows(
    logits: Float[Array, "rows vocab"],
    history: History,
    n_new: Int[Array, " rows"],
    keys: UInt[Array, "rows 2"] | Key[Array, " rows"],
    positions: Int[Array, " rows"],
    sampling: Sampling,
) -> tuple[Int[Array, " rows"], Float[Array, " rows"], Float[Array, " rows"]]:
    """`choose_token` for each row with the row's own settings (every field of `sampling`
    with a leading rows axis): the engine's slots.

    Under `jax.vmap` a per-row temperature would turn the greedy-or-sample branch into a
    select that sorts the vocabulary for every row at every step; when no row samples,
    the greedy branch runs alone, as it does for a `generate` call. Each row's token is
    the one `choose_token` gives that row alone. Likewise the vocabulary is sorted (for
    top-k and top-p) only when some row asks for either.
    """
    def some_sample(_):
        sorts = needs_sort(sampling.top_k, sampling.top_p, logits.shape[-1])
        choose = jax.vmap(choose_token, in_axes=(0, 0, 0, 0, 0, 0, None))
        return choose(logits, history, n_new, keys, positions, sampling, sorts)

    def all_greedy(_):
        greedy = sampling._replace(temperature=jnp.zeros((), jnp.float32))
        axes = Sampling(*(None if name == "temperature" else 0 for name in Sampling._fields))
        choose = jax.vmap(choose_token, in_axes=(0, 0, 0, 0, 0, axes))
        return choose(logits, history, n_new, keys, positions, greedy)

    return jax.lax.cond(jnp.any(jnp.asarray(sampling.temperature) > 0), some_sample, all_greedy, None)


def model_logprob(
    logits: Float[Array, " vocab"], token: Int[Array, ""], sampling: Sampling
) -> Float[Array, ""]:
    """`token`'s log-probability under the model's own distribution at the sampling
    temperature, `log_softmax(logits / temperature)[token]` (temperature 1 when greedy),
    without penalties, masks or truncation."""
    return logprob_of(tempered(logits.astype(jnp.float32), sampling.temperature), token)


def tempered(logits: Float[Array, " vocab"], temperature: Float[ArrayLike, ""]) -> Float[Array, " vocab"]:
    """`logits / temperature`, temperature 1 when greedy (0). `model_logprob` and the
    sampled draw (`pick`) both divide so: one expression, one compiled kernel for the
    reciprocal XLA takes of it."""
    temperature = jnp.asarray(temperature).astype(jnp.float32)
    return logits / jnp.where(temperature > 0, temperature, 1.0)


def logprob_of(
    logits: Float[Array, " vocab"], token: Int[Array, ""], top: Float[Array, ""] | None = None
) -> Float[Array, ""]:
    """`jax.nn.log_softmax(logits)[token]`, bit for bit, without the vector: the token's
    shifted logit less the log of the shifted sum (one reduction instead of a vocabulary of
    log-probabilities, of which one entry is read). `top`: `max(logits)`, when known."""
    top = jax.lax.stop_gradient(jnp.max(logits) if top is None else top)
    return (entry(logits, token) - top) - jnp.log(jnp.sum(jnp.exp(logits - top)))


def entry(logits: Float[Array, " vocab"], token: Int[Array, ""]) -> Float[Array, ""]:
    """`logits[token]` for a token id (in range, never negative): one slice, without the
    wrapping of negative indices that `[]` traces."""
    return jax.lax.dynamic_index_in_dim(logits, token, keepdims=False, allow_negative_indices=False)


def sample_token(
    logits: Float[Array, " vocab"],
    key: UInt[Array, "2"] | Key[Array, ""],
    position: Int[Array, ""],
    sampling: Sampling,
    sorts: Bool[ArrayLike, ""] | None = None,
) -> tuple[Int[Array, ""], Float[Array, ""]]:
    """Sample the token at `position` of a row whose key is `key`; `temperature == 0` is
    greedy (`sorts`: see `_processors.truncate`).

    **Returns:** `(token, logprob)`, `logprob` the token's log-probability under the
    distribution it was chosen from (see `draw`).
    """
    token, chosen_from, top = pick(logits.astype(jnp.float32), key, position, sampling, sorts)
    return token, logprob_of(chosen_from, token, top)


def draw(
    logits: Float[Array, " vocab"],
    key: UInt[Array, "2"] | Key[Array, ""],
    position: Int[Array, ""],
    sampling: Sampling,
    sorts: Bool[ArrayLike, ""] | None = None,
) -> tuple[Int[Array, ""], Float[Array, " vocab"]]:
    """The token at `position` from float32 (processed) logits (`pick`'s arguments), and
    the log-probabilities of the distribution it was chosen from (the speculative
    programs read them all; `sample_token` reads the token's alone)."""
    token, chosen_from, _ = pick(logits, key, position, sampling, sorts)
    return token, jax.nn.log_softmax(chosen_from)


def pick(
    logits: Float[Array, " vocab"],
    key: UInt[Array, "2"] | Key[Array, ""],
    position: Int[Array, ""],
    sampling: Sampling,
    sorts: Bool[ArrayLike, ""] | None = None,
) -> tuple[Int[Array, ""], Float[Array, " vocab"], Float[Array, ""]]:
    """The token at `position` from float32 (processed) logits, the logits of the
    distribution it was chosen from, and their largest.

    Greedy: the argmax, `logits`, and the argmax's logit. Sampling: the logits are divided by
    the temperature and truncated with top-k, top-p and min-p
    (`eqrope.generation._processors.truncate`), and the token is drawn from them with
    `jax.random.fold_in(key, position)`, derived only when sampling (greedy decoding
    spends nothing on keys); they are the logits returned.
    The vocabulary is sorted only for top-k or top-p: `sorts`, default this row's
    settings (see `_processors.truncate`); given, it is the batch's, and both the greedy
    and the sampled token are computed, the row's temperature choosing.
    """
    temperature = jnp.asarray(sampling.temperature)

    def greedy(_):
        token = jnp.argmax(logits).astype(jnp.int32)
        return token, logits, entry(logits, token)

    def sample(_):
        scaled = tempered(logits, temperature)
        filtered, top = truncate(scaled, sampling.top_k, sampling.top_p, sampling.min_p, sorts)
        token = jax.random.categorical(jax.random.fold_in(key, position), filtered)
        return token.astype(jnp.int32), filtered, top

    if sorts is None:
        # A real branch, not a select: greedy decoding skips the sort and the random draw.
        return jax.lax.cond(temperature > 0, sample, greedy, None)
    # The batch's `sorts` (`choose_rows`): under `jax.vmap` with a temperature per row a
    # `cond` would be a select anyway, whose branches see every value batched, `sorts`
    # too; so the select is written out, and the sort keeps its branch.
    return jax.tree.map(lambda s, g: jnp.where(temperature > 0, s, g), sample(None), greedy(None))


def row_keys(key: Key[Array, ""], batch: int, batched: bool, samples: int | None) -> Key[Array, " rows"]:
    """The key of each row of a `generate` call, `(batch * samples,)`, sample-minor.

    Row `i` of a batch has `jax.random.split(key, batch)[i]`, a 1-D prompt has `key`;
    with `num_samples=n`, sample `j` of a row whose key is `k` has
    `jax.random.split(k, n)[j]`.
    """
    keys = jax.random.split(key, batch) if batched else key[None]
    if samples is None:
        return keys
    return jax.vmap(lambda k: jax.random.split(k, samples))(keys).reshape(-1)
