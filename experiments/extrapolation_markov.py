"""The second task of `extrapolation.py`: an order-2 Markov language over 16 tokens.

Each token depends on the two before it only, through a fixed table of next-token
probabilities drawn once (rows from a Dirichlet with concentration 0.2, so most contexts
have a few likely successors). A sequence starts from the chain's stationary distribution
over pairs, so the statistics at position 500 are those at position 5: the useful
distances are 1 and 2, and nothing changes with position. That is the "natural text" case
of the textbook's section 2.4, stripped down to where it can be computed exactly.

The best possible loss is known. Predicting token `t + 1` from tokens `0 .. t` costs, at
best, the conditional entropy `H(x[t+1] | x[t])` for `t = 0` and the chain's entropy rate
`H(x[t+1] | x[t-1], x[t])` for every `t >= 1` (`floor_by_position`).

Everything here is NumPy on the host, from a `numpy.random.Generator`.
"""

import dataclasses

import numpy as np


VOCAB_SIZE = 16
ORDER = 2
CONCENTRATION = 0.2
CHAIN_SEED = 2024


@dataclasses.dataclass(frozen=True)
class MarkovChain:
    """`probs[a, b]` is the distribution of the token after `a b`; `start[a, b]` is the
    stationary probability of the pair `a b`."""

    probs: np.ndarray  # (VOCAB_SIZE, VOCAB_SIZE, VOCAB_SIZE), float64, rows sum to 1
    start: np.ndarray  # (VOCAB_SIZE, VOCAB_SIZE), float64, sums to 1


def make_chain(seed: int = CHAIN_SEED) -> MarkovChain:
    """The task's chain: Dirichlet(0.2) rows, and the stationary pair distribution found by
    iterating the pair chain `(a, b) -> (b, c)` to a fixed point."""
    rng = np.random.default_rng(seed)
    v = VOCAB_SIZE
    probs = rng.dirichlet(np.full(v, CONCENTRATION), size=(v, v))
    pair = np.full((v, v), 1.0 / v**2)
    for _ in range(10_000):
        # new[b, c] = sum_a pair[a, b] * probs[a, b, c]
        new = np.einsum("ab,abc->bc", pair, probs)
        if np.abs(new - pair).max() < 1e-15:
            break
        pair = new
    return MarkovChain(probs=probs, start=new / new.sum())


def sample(chain: MarkovChain, rng: np.random.Generator, n: int, length: int) -> np.ndarray:
    """`n` sequences of `length >= 2` tokens, int32 of shape `(n, length)`."""
    v = VOCAB_SIZE
    out = np.empty((n, length), np.int32)
    first = rng.choice(v * v, size=n, p=chain.start.ravel())
    out[:, 0], out[:, 1] = first // v, first % v
    cdf = np.cumsum(chain.probs, axis=-1)
    for t in range(2, length):
        rows = cdf[out[:, t - 2], out[:, t - 1]]
        out[:, t] = np.minimum((rng.random((n, 1)) > rows).sum(-1), v - 1)
    return out


def _entropy(p: np.ndarray) -> np.ndarray:
    return -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), axis=-1)


def entropy_rate(chain: MarkovChain) -> float:
    """`H(x[t+1] | x[t-1], x[t])` in nats: the best loss once two tokens are known."""
    return float(np.sum(chain.start * _entropy(chain.probs)))


def floor_by_position(chain: MarkovChain, positions: int) -> np.ndarray:
    """The best expected loss at positions `0 .. positions - 1` (nats)."""
    marginal = chain.start.sum(axis=0)  # of the second token, = of every token
    given_one = np.einsum("ab,abc->bc", chain.start, chain.probs) / marginal[:, None]
    # given_one[b, c] = P(next = c | current = b)
    floor = np.full(positions, entropy_rate(chain))
    floor[0] = float(np.sum(marginal * _entropy(given_one)))
    return floor
