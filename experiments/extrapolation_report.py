"""Tables and figures of `extrapolation.py`, all read from its record (the JSON), so that
they can be redrawn from `experiments/results/extrapolation.json` alone:

    python experiments/extrapolation_report.py     # rewrites extrapolation.md and the figures
"""

import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from reversal_report import with_interval


GROUPS = ((3, 8), (9, 12), (13, 16))  # trained on; fine-tuned on; never trained on
QUARTERS = ((0, 32), (32, 64), (64, 96), (96, 128))
LABELS = {"none": "no scaling", "linear": "linear (PI)", "ntk": "NTK base",
          "dynamic": "dynamic NTK", "yarn": "YaRN", "llama3": "llama3", "learned": "learned positions"}


def label(method: str, factor: float) -> str:
    return LABELS[method] if method in ("none", "learned") else f"{LABELS[method]} ×{factor:g}"


def summary(counts: dict[int, int], total: int) -> str:
    """One line for the log: exact matches per group of lengths."""
    parts = []
    for low, high in GROUPS:
        lengths = [n for n in counts if low <= n <= high]
        if lengths:
            parts.append(f"{low}-{high}: {sum(counts[n] for n in lengths)}/{total * len(lengths)}")
    return ", ".join(parts)


def quarters(loss: np.ndarray) -> str:
    return " ".join(f"{np.mean(loss[a:b]):.3f}" for a, b in QUARTERS if a < len(loss))


def dumps(record: dict) -> str:
    """The record as JSON: indented, with one line per result."""
    head = json.dumps({k: v for k, v in record.items() if k != "results"}, indent=2)
    rows = ",\n".join("    " + json.dumps(r) for r in record["results"])
    return head[:-2] + ',\n  "results": [\n' + rows + "\n  ]\n}\n"


# -- the tables -----------------------------------------------------------------------------


def reversal_cells(record: dict, finetune: bool) -> dict:
    """`{(method, factor): {seed: {length: (correct, total)}}}`, in the order run."""
    out: dict = {}
    for r in record["results"]:
        if r["task"] == "reversal" and r["finetune"] == finetune:
            key = (r["method"], r["factor"])
            out.setdefault(key, {}).setdefault(r["seed"], {})[r["length"]] = (r["correct"], r["total"])
    return out


def tested_lengths(cells: dict) -> list[int]:
    return sorted({n for by_seed in cells.values() for s in by_seed.values() for n in s})


def group_counts(by_seed: dict, low: int, high: int) -> list[tuple[int, int]]:
    """Per seed, `(correct, total)` over the lengths `low .. high`."""
    out = []
    for seed in sorted(by_seed):
        cells = [v for n, v in by_seed[seed].items() if low <= n <= high]
        out.append((sum(c for c, _ in cells), sum(t for _, t in cells)))
    return out


def reversal_table(record: dict, finetune: bool) -> list[str]:
    cells = reversal_cells(record, finetune)
    groups = [(lo, hi) for lo, hi in GROUPS if any(lo <= n <= hi for n in tested_lengths(cells))]
    if not groups:
        return []
    head = "| rope | " + " | ".join(
        f"{lo}–{hi}: all seeds (95% interval) | {lo}–{hi}: per seed, % (spread)" for lo, hi in groups
    ) + " |"
    lines = [head, "|---|" + "---|---|" * len(groups)]
    for (method, factor), by_seed in cells.items():
        row = []
        for lo, hi in groups:
            per_seed = group_counts(by_seed, lo, hi)
            pooled = (sum(c for c, _ in per_seed), sum(t for _, t in per_seed))
            rates = [100 * c / t for c, t in per_seed]
            row.append(
                f"{with_interval(*pooled)} | {', '.join(f'{x:.1f}' for x in rates)} "
                f"({max(rates) - min(rates):.1f})"
            )
        lines.append(f"| {label(method, factor)} | " + " | ".join(row) + " |")
    return lines


def by_length_table(record: dict, finetune: bool) -> list[str]:
    cells = reversal_cells(record, finetune)
    lengths = tested_lengths(cells)
    if not lengths:
        return []
    lines = ["| rope | " + " | ".join(map(str, lengths)) + " |", "|---|" + "---:|" * len(lengths)]
    for (method, factor), by_seed in cells.items():
        rates = [np.mean([100 * s[n][0] / s[n][1] for s in by_seed.values()]) for n in lengths]
        lines.append(f"| {label(method, factor)} | " + " | ".join(f"{x:.1f}" for x in rates) + " |")
    return lines


def markov_curves(record: dict) -> dict:
    """`{(method, factor): {seed: loss by position}}`."""
    out: dict = defaultdict(lambda: defaultdict(dict))
    for r in record["results"]:
        if r["task"] == "markov":
            out[(r["method"], r["factor"])][r["seed"]][r["position"]] = r["loss"]
    return {
        key: {seed: np.array([v[p] for p in sorted(v)]) for seed, v in by_seed.items()}
        for key, by_seed in out.items()
    }


def markov_table(record: dict) -> list[str]:
    curves = markov_curves(record)
    if not curves:
        return []
    settings = record["settings"]["markov"]
    n = settings["eval_len"]
    quarters_ = [(a, b) for a, b in QUARTERS if b <= n]
    lines = [
        "| model, rope | " + " | ".join(f"positions {a}–{b - 1}" for a, b in quarters_) + " |",
        "|---|" + "---:|" * len(quarters_),
    ]
    for (method, factor), by_seed in curves.items():
        row = []
        for a, b in quarters_:
            means = [float(np.mean(c[a:b])) for c in by_seed.values()]
            row.append(f"{np.mean(means):.3f} ({min(means):.3f}–{max(means):.3f})")
        name = "learned positions" if method == "learned" else f"rotary, {label(method, factor)}"
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    return lines


def markdown(record: dict) -> str:
    s = record["settings"]
    seeds = s["seeds"]
    lines = [
        "# Scaling the rotation rates after training",
        "",
        f"Written by `{record['command']}`. Reversal: the chapter's rotary checkpoints "
        f"(`{s['source']}`, trained on lengths 3–8, seeds {seeds}), "
        f"{s['n_per_length']} fresh strings per length and seed, exact match, greedy with "
        f"the cache; `original_max_len` = {s['reversal_original_max_len']} (the longest "
        "training sequence). Each cell: correct/total over all seeds with its Wilson 95% "
        "interval, then each seed's rate in % and the spread (largest minus smallest).",
        "",
        "## Reversal, no retraining",
        "",
        *reversal_table(record, False),
    ]
    tuned = reversal_table(record, True)
    if tuned:
        f = s["finetune"]
        lines += [
            "",
            f"## Reversal, after fine-tuning {f['steps']} steps of {f['batch']} on lengths "
            f"{f['lengths'][0]}–{f['lengths'][-1]} (peak lr {f['lr']:g}) with each rope",
            "",
            *tuned,
        ]
    for finetune, title in ((False, "no retraining"), (True, "fine-tuned")):
        table = by_length_table(record, finetune)
        if table:
            lines += ["", f"### Exact match by length, % (mean of seeds), {title}", "", *table]
    table = markov_table(record)
    if table:
        m = s["markov"]
        lines += [
            "",
            f"## Order-{m['order']} Markov language ({m['vocab']} tokens), trained on "
            f"{m['train_len']} positions",
            "",
            f"Mean next-token loss (nats) over {m['eval_sequences']} sequences of "
            f"{m['eval_len']} tokens, by range of positions; mean of seeds (smallest–largest). "
            f"The best possible is {m['entropy_rate']:.3f} at every position after the first "
            f"({m['floor_by_position'][0]:.3f} at position 0). `original_max_len` = "
            f"{m['train_len']}.",
            "",
            *table,
        ]
    return "\n".join(lines) + "\n"


# -- the figures ----------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_reversal(record: dict, path: Path) -> None:
    """Exact match by length, as the chapter's Figure 2.2: one panel per factor without
    retraining, one after fine-tuning; large markers the mean of seeds, small dots single
    seeds; shaded: lengths the chapter's models never trained on (darker: beyond the
    fine-tuning lengths too)."""
    plain, tuned = reversal_cells(record, False), reversal_cells(record, True)
    if not plain and not tuned:
        return
    factors = sorted({f for m, f in plain if m != "none"})
    panels = [(f"no retraining, factor {f:g}", plain, f) for f in factors]
    if tuned:
        panels.append(("fine-tuned on lengths 3–12", tuned, None))
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.9), sharey=True,
                             squeeze=False)
    for ax, (title, cells, factor) in zip(axes[0], panels):
        lengths: set[int] = set()
        for (method, f), by_seed in cells.items():
            if factor is not None and method != "none" and f != factor:
                continue
            xs = sorted({n for s in by_seed.values() for n in s})
            lengths.update(xs)
            rates = np.array([[s[n][0] / s[n][1] for n in xs] for s in by_seed.values()])
            marker = "o" if method == "none" else "s^v<>"[[*LABELS].index(method) % 5]
            (line,) = ax.plot(xs, rates.mean(0), marker=marker, ms=4, label=label(method, f),
                              color="black" if method == "none" else None)
            for row in rates:
                ax.scatter(xs, row, s=6, alpha=0.35, color=line.get_color())
        for n in sorted(lengths):
            if n > 8:
                ax.axvspan(n - 0.5, n + 0.5, color="0.78" if n > 12 else "0.9", zorder=0, lw=0)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("string length")
        ax.set_xticks(sorted(lengths))
        ax.set_ylim(-0.03, 1.03)
        ax.legend(fontsize=7, loc="upper right" if factor is not None else "lower left")
    axes[0][0].set_ylabel("exact-match accuracy")
    fig.suptitle("String reversal: the chapter's rotary models (trained on lengths 3–8) under "
                 "each rope\nshaded: lengths not trained on (darker: not fine-tuned on either)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_markov(record: dict, path: Path) -> None:
    """Loss against position on the Markov task, one panel per factor: mean of seeds (single
    seeds faint); the dotted line is the best possible loss; shaded: beyond training."""
    curves = markov_curves(record)
    if not curves:
        return
    m = record["settings"]["markov"]
    factors = sorted({f for (method, f) in curves if method not in ("none", "learned")}) or [1.0]
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(factors), figsize=(6 * len(factors), 4), sharey=True,
                             squeeze=False)
    for ax, factor in zip(axes[0], factors):
        for (method, f), by_seed in curves.items():
            if method not in ("none", "learned") and f != factor:
                continue
            rows = np.stack(list(by_seed.values()))
            xs = np.arange(rows.shape[1])
            color = {"none": "black", "learned": "0.55"}.get(method)
            (line,) = ax.plot(xs, rows.mean(0), lw=1.4, label=label(method, f), color=color,
                              ls="--" if method == "learned" else "-")
            for row in rows:
                ax.plot(xs, row, lw=0.5, alpha=0.3, color=line.get_color())
        ax.axhline(m["entropy_rate"], color="0.3", ls=":", lw=1, label="best possible")
        ax.axvspan(m["train_len"] - 0.5, m["eval_len"], color="0.9", zorder=0, lw=0)
        ax.set_title(f"factor {factor:g}", fontsize=10)
        ax.set_xlabel("position")
        ax.set_ylim(1.4, 4.6)
        ax.legend(fontsize=7, loc="upper left")
    axes[0][0].set_ylabel("next-token loss (nats)")
    fig.suptitle(f"Order-{m['order']} Markov language, trained on {m['train_len']} positions"
                 "\nshaded: positions never trained on", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    out = Path("experiments/results")
    record = json.loads((out / "extrapolation.json").read_text())
    (out / "extrapolation.md").write_text(markdown(record))
    plot_reversal(record, out / "extrapolation.png")
    plot_markov(record, out / "extrapolation_markov.png")


if __name__ == "__main__":
    main()
