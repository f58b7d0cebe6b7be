"""RoPE's relative property, checked numerically (the textbook's section 2.2, Figure 2.1).

One random query and one random key are rotated with `eqrope.apply_rope` to every position
from 0 to 63. The dot product of the query at position m with the key at position n should
depend on m - n only:

- dimension 2: the dot product at (5, 2) equals the one at (40, 37);
- dimension 32: the same, and over all 2,080 pairs with n <= m the largest spread among
  pairs at the same distance (float32 rounding, the chapter: 4.1e-6).

The same dot products are recomputed in float64 with NumPy from the rotation matrix of
RoFormer Eq. (15), as an independent reference for `apply_rope`.

Run from the repository root:

    python experiments/rope_check.py

Writes `rope_check.json` and `rope_check.png` (the two panels of Figure 2.1) to `--out`
(default `experiments/results`).
"""

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import eqrope


N_POSITIONS = 64


def rotated_dots(q, k, base: float = 10000.0) -> np.ndarray:
    """`S[m, n] = rope(q, m) . rope(k, n)` for `m, n` in `0 .. 63`, with eqrope in float32."""
    dim = q.shape[0]
    positions = jnp.arange(N_POSITIONS, dtype=jnp.int32)
    inv_freq = eqrope.rope_inv_freq(dim, base)
    qs = eqrope.apply_rope(jnp.broadcast_to(q, (N_POSITIONS, 1, dim)), positions, inv_freq)[:, 0]
    ks = eqrope.apply_rope(jnp.broadcast_to(k, (N_POSITIONS, 1, dim)), positions, inv_freq)[:, 0]
    return np.asarray(qs @ ks.T)


def reference_dots(q, k, base: float = 10000.0) -> np.ndarray:
    """The same matrix in float64, rotating each pair `(x[2i], x[2i+1])` by its 2x2 matrix."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    dim = q.shape[0]
    theta = base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)

    def rotate(x, m):
        out = np.empty_like(x)
        for i, t in enumerate(theta):
            c, s = np.cos(m * t), np.sin(m * t)
            out[2 * i] = c * x[2 * i] - s * x[2 * i + 1]
            out[2 * i + 1] = s * x[2 * i] + c * x[2 * i + 1]
        return out

    qs = np.stack([rotate(q, m) for m in range(N_POSITIONS)])
    ks = np.stack([rotate(k, n) for n in range(N_POSITIONS)])
    return qs @ ks.T


def spread_by_distance(dots: np.ndarray) -> tuple[float, int, int]:
    """The largest `max - min` among pairs `n <= m` at the same distance `m - n`.

    **Returns:** `(spread, distance where it occurs, number of pairs)`.
    """
    worst, where, pairs = 0.0, 0, 0
    for d in range(N_POSITIONS):
        values = np.array([dots[m, m - d] for m in range(d, N_POSITIONS)], np.float64)
        pairs += len(values)
        if values.max() - values.min() > worst:
            worst, where = float(values.max() - values.min()), d
    return worst, where, pairs


def check(dim: int, *, key) -> dict:
    """Every number of the check for one random query and key of dimension `dim`."""
    q_key, k_key = jax.random.split(key)
    q = jax.random.normal(q_key, (dim,), jnp.float32)
    k = jax.random.normal(k_key, (dim,), jnp.float32)
    dots = rotated_dots(q, k)
    reference = reference_dots(q, k)
    spread, distance, pairs = spread_by_distance(dots)
    return {
        "dim": dim,
        "dot_5_2": float(dots[5, 2]),
        "dot_40_37": float(dots[40, 37]),
        "spread": spread,
        "spread_distance": distance,
        "pairs": pairs,
        "spread_float64_reference": spread_by_distance(reference)[0],
        "max_abs_diff_vs_float64_reference": float(np.max(np.abs(dots - reference))),
        "dots": dots,
    }


def plot(dots: np.ndarray, path: Path) -> None:
    """Figure 2.1: the heatmap over (m, n), and the values for n <= m against m - n."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    image = left.imshow(dots, origin="lower", cmap="RdBu_r", vmin=-np.abs(dots).max(), vmax=np.abs(dots).max())
    left.set_xlabel("key position n")
    left.set_ylabel("query position m")
    left.set_title("rope(q, m) · rope(k, n)")
    fig.colorbar(image, ax=left, shrink=0.85)
    m, n = np.tril_indices(N_POSITIONS)
    right.scatter(m - n, dots[m, n], s=8, alpha=0.15, color="k", lw=0)
    right.set_xlabel("distance m − n")
    right.set_ylabel("dot product")
    right.set_title(f"all {len(m):,} pairs with n ≤ m")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0, help="PRNG seed of the query and key")
    parser.add_argument("--out", type=Path, default=Path("experiments/results"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    key2, key32 = jax.random.split(jax.random.PRNGKey(args.seed))
    results = {"seed": args.seed, "positions": N_POSITIONS}
    for dim, key in ((2, key2), (32, key32)):
        r = check(dim, key=key)
        dots = r.pop("dots")
        results[f"dim{dim}"] = r
        print(
            f"dim {dim:2d}: q·k at (5, 2) = {r['dot_5_2']:.4f}, at (40, 37) = {r['dot_40_37']:.4f}; "
            f"largest spread over {r['pairs']} pairs = {r['spread']:.2g} (distance "
            f"{r['spread_distance']}), float64 reference {r['spread_float64_reference']:.2g}, "
            f"eqrope vs reference {r['max_abs_diff_vs_float64_reference']:.2g}"
        )
    plot(dots, args.out / "rope_check.png")
    (args.out / "rope_check.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out / 'rope_check.json'} and {args.out / 'rope_check.png'}")
    return results


if __name__ == "__main__":
    main()
