"""The tables and the figure of `reversal.py`, from its record (the JSON): counts with their
Wilson 95% intervals, correct answers by length and by position, accuracy by length.
"""

import math
from pathlib import Path

import numpy as np

import reversal_data as data


def wilson(correct: int, total: int, z: float = 1.959964) -> tuple[float, float]:
    """The Wilson score interval for a binomial rate (95% for the default `z`).

    **Returns:** `(low, high)`, within [0, 1]; `(0, 1)` when `total` is 0.

    ??? cite "Reference"

        Wilson 1927, "Probable inference, the law of succession, and statistical
        inference", JASA 22(158), 209-212.
    """
    if total == 0:
        return 0.0, 1.0
    p = correct / total
    denominator = 1 + z * z / total
    centre = (p + z * z / (2 * total)) / denominator
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


def with_interval(correct: int, total: int) -> str:
    """`"3/500 (0.2-1.7%)"`: a count and its Wilson 95% interval, in percent."""
    low, high = wilson(correct, total)
    return f"{correct}/{total} ({100 * low:.1f}–{100 * high:.1f}%)"


def markdown_table(result: dict) -> str:
    """Correct answers by length: the mean over seeds, each seed's count with its Wilson 95%
    interval, and (when measured) each seed's count on the large sample."""
    models = list(result["runs"])
    seeds = result["settings"]["seeds"]
    large = result["settings"].get("large_sample", {}).get("n", 0)
    extra = f" | {{m}}: {large:,} fresh strings, per seed" if large else ""
    lines = [
        f"Exact-match answers by string length, `{result['name']}` "
        f"(trained on lengths {result['settings']['train_lengths_text']}, seeds {seeds}). "
        "Each count has its Wilson 95% interval. The fixed test set is one draw of "
        f"{result['settings']['n_test']} strings per test set"
        + (
            f"; the large-sample columns test the same checkpoints on {large:,} other fresh "
            f"strings per test set (seed {result['settings']['large_sample']['seed']})."
            if large else "."
        ),
        "",
        "| lengths | length | strings | "
        + " | ".join(f"{m}: mean | {m}: per seed" + extra.format(m=m) for m in models)
        + " |",
        "|---|---:|---:|" + ("---:|---|" + ("---|" if large else "")) * len(models),
    ]
    for spec in result["settings"]["test_lengths"]:
        by_length = result["runs"][models[0]][0]["tests"][spec]["by_length"]
        rows = [(n, count[1]) for n, count in by_length.items()] + [("all", None)]
        for n, total in rows:
            cells = []
            for m in models:
                runs = result["runs"][m]
                if n == "all":
                    pairs = [(r["tests"][spec]["correct"], r["tests"][spec]["total"]) for r in runs]
                    total = pairs[0][1]
                    big = [(r["large_sample"][spec]["correct"], r["large_sample"][spec]["total"])
                           for r in runs if large]
                else:
                    pairs = [r["tests"][spec]["by_length"][n] for r in runs]
                    big = [r["large_sample"][spec]["by_length"].get(n, [0, 0])
                           for r in runs if large]
                cell = f"{np.mean([c for c, _ in pairs]):.1f} | " + "; ".join(
                    with_interval(c, t) for c, t in pairs
                )
                if large:
                    cell += " | " + "; ".join(with_interval(c, t) for c, t in big)
                cells.append(cell)
            label = f"**{n}**" if n == "all" else n
            lines.append(f"| {spec} | {label} | {total} | " + " | ".join(cells) + " |")
    lines += ["", "Answer letters right (greedy, all positions of the answer), per seed:", ""]
    for spec in result["settings"]["test_lengths"]:
        cells = []
        for m in models:
            fractions = [r["tests"][spec]["letter_accuracy"] for r in result["runs"][m]]
            cells.append(f"{m} {np.mean(fractions):.3f} ({', '.join(f'{f:.3f}' for f in fractions)})")
        lines.append(f"- lengths {spec}: " + "; ".join(cells))
    lines += position_table(result)
    lines += ["", "Cache equality (identical greedy tokens with and without the cache):", ""]
    for m in models:
        counts = [f"{r['cache_equal'][0]}/{r['cache_equal'][1]}" for r in result["runs"][m]]
        lines.append(f"- {m}: " + ", ".join(counts) + " (per seed)")
    return "\n".join(lines) + "\n"


def position_table(result: dict) -> list[str]:
    """For the shortest length not trained on: per answer position, the share of strings
    with the right letter there, and the share with the string's first letter there."""
    train = set(result["settings"]["train_lengths"])
    first_run = next(iter(result["runs"].values()))[0]
    unseen = [(int(n), spec) for spec, t in first_run["tests"].items() for n in t["by_position"]]
    unseen = sorted((n, spec) for n, spec in unseen if n not in train)
    if not unseen:
        return []
    n, spec = unseen[0]
    head = " | ".join(str(j + 1) for j in range(n))
    lines = [
        "",
        f"Strings of length {n} (not trained on), by answer position (1 = first letter written "
        "after SEP): share with the right letter / share with the string's first letter.",
        "",
        f"| model | seed | {head} |",
        "|---|---:|" + "---|" * n,
    ]
    for m, runs in result["runs"].items():
        for r in runs:
            counts = r["tests"][spec]["by_position"][str(n)]
            total = r["tests"][spec]["by_length"][str(n)][1]
            cells = " | ".join(
                f"{right / total:.2f} / {first / total:.2f}"
                for right, first in zip(counts["right"], counts["first_letter"])
            )
            lines.append(f"| {m} | {r['seed']} | {cells} |")
    return lines


def plot(result: dict, path: Path) -> None:
    """Accuracy by length, like the chapter's Figure 2.2: exact match on the left, answer
    letters right on the right; lengths the models did not train on are shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train_lengths = set(result["settings"]["train_lengths"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharex=True)
    panels = (("by_length", "exact-match accuracy"), ("letters_by_length", "answer letters right"))
    tested: set[int] = set()
    for ax, (field, ylabel) in zip(axes, panels):
        for m, marker in zip(result["runs"], "os^v"):
            per_seed: dict[int, list[float]] = {}
            for run in result["runs"][m]:
                for test in run["tests"].values():
                    for n, (right, total) in test[field].items():
                        per_seed.setdefault(int(n), []).append(right / total)
            lengths = sorted(per_seed)
            tested.update(lengths)
            means = [np.mean(per_seed[n]) for n in lengths]
            (line,) = ax.plot(lengths, means, marker=marker, label=f"{m} (mean of {len(result['runs'][m])} seeds)")
            for n in lengths:
                ax.scatter([n] * len(per_seed[n]), per_seed[n], s=10, alpha=0.4, color=line.get_color())
        for n in sorted(tested - train_lengths):
            ax.axvspan(n - 0.5, n + 0.5, color="0.85", zorder=0, lw=0)
        ax.set_xlabel("string length")
        ax.set_ylabel(ylabel)
        ax.set_ylim(-0.03, 1.03)
        ax.set_xticks(sorted(tested))
    axes[1].axhline(1 / data.N_LETTERS, color="0.5", ls=":", lw=1, label="chance (1/10)")
    axes[0].legend(fontsize=8, loc="center left")
    axes[1].legend(fontsize=8, loc="best")
    fig.suptitle(f"String reversal ({result['name']}); shaded: lengths not trained on", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
