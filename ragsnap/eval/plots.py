"""PNG plots of a run (matplotlib, Agg backend, imported only when plotting).

``score_vs_budget.png`` draws every press with its own marker and line style, offset a
little along x so identical series stay visible, with bootstrap 95% error bars; titles
and legends carry the number of items, axes their units.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ragsnap.eval.aggregate import needle_grid

HEADLINE = ("needle_accuracy", "accuracy", "factoid_lenient", "list_f1", "rouge_l")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
LINESTYLES = ("-", "--", "-.", ":")
OFFSET = 0.06  # log2 units between neighbouring presses at one x
AXIS_LABELS = {
    "kl": "KL to the full cache (nats per answer token)",
    "nll_gap": "NLL gap (nats per answer token)",
    "agreement": "agreement with the full cache (share of items)",
}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def budget_label(budget: float | None) -> str:
    """A run's size: ``all`` (full cache), a budget in tokens, or a ratio of the prompt."""
    return "all" if budget is None else str(budget)


def _error(run: dict[str, Any], key: str, value: float) -> tuple[float, float]:
    ci = run.get("ci", {}).get(key)
    return (value - ci[0], ci[1] - value) if ci else (0.0, 0.0)


def _series(ax: Any, runs: Sequence[dict[str, Any]], key: str, presses: Sequence[str]) -> None:
    middle = (len(presses) - 1) / 2
    for j, press in enumerate(presses):
        pts = [r for r in runs if r["press"] == press and r["metrics"].get(key) is not None]
        if not pts:
            continue
        shift = 2 ** ((j - middle) * OFFSET)
        values = [r["metrics"][key] for r in pts]
        errors = [_error(r, key, v) for r, v in zip(pts, values, strict=True)]
        ax.errorbar(
            [r["budget"] * shift for r in pts],
            values,
            yerr=[[e[0] for e in errors], [e[1] for e in errors]],
            marker=MARKERS[j % len(MARKERS)],
            linestyle=LINESTYLES[j % len(LINESTYLES)],
            capsize=3,
            label=f"{press} (n={max(r['n'] for r in pts)})",
        )


def plot_scores(out_dir: Path, runs: Sequence[dict[str, Any]]) -> list[str]:
    """``score_vs_budget.png``: headline score, agreement and KL vs budget (or ratio), one
    series per press with 95% bootstrap error bars; the full cache as a line and band."""
    headline = next((k for k in HEADLINE if any(k in r["metrics"] for r in runs)), None)
    panels = [k for k in (headline, "agreement", "kl") if k]
    sizes = sorted({r["budget"] for r in runs if r["budget"] is not None})
    if not sizes:
        return []
    ratio = any(isinstance(b, float) for b in sizes)
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2), squeeze=False)
    full = next((r for r in runs if r["press"] == "full"), None)
    presses = list(dict.fromkeys(r["press"] for r in runs if r["press"] != "full"))
    items = max(r["n"] for r in runs)
    for ax, key in zip(axes[0], panels, strict=True):
        _series(ax, runs, key, presses)
        if full is not None and full["metrics"].get(key) is not None:
            value = full["metrics"][key]
            ax.axhline(value, color="black", linestyle="--", label=f"full (n={full['n']})")
            ci = full.get("ci", {}).get(key)
            if ci:
                ax.axhspan(ci[0], ci[1], color="black", alpha=0.08)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [f"{b:g}" for b in sizes])
        ax.set_xlabel(
            "ratio (share of the prompt kept per KV head)"
            if ratio
            else "budget (tokens kept per KV head)"
        )
        ax.set_ylabel(AXIS_LABELS.get(key, f"{key} (share of items)"))
        if key not in ("kl", "nll_gap"):  # shares: the whole 0-1 range, so 0 looks like 0
            ax.set_ylim(-0.05, 1.05)
        ax.set_title(f"{key} (n={items} items, 95% bootstrap CI)", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "score_vs_budget.png", dpi=100)
    plt.close(fig)
    return ["score_vs_budget.png"]


def plot_needles(out_dir: Path, records: Sequence[dict[str, Any]]) -> list[str]:
    """``needle_heatmap_<press>.png``: accuracy by depth (rows) x length (columns), one
    panel per budget."""
    grids = needle_grid(records)
    if not grids:
        return []
    plt = _pyplot()
    written = []
    for press in dict.fromkeys(p for p, _ in grids):
        points = sorted((b for p, b in grids if p == press), key=lambda b: -1 if b is None else b)
        fig, axes = plt.subplots(1, len(points), figsize=(3.2 * len(points) + 1, 4), squeeze=False)
        image = None
        for ax, budget in zip(axes[0], points, strict=True):
            cells = grids[(press, budget)]
            lengths = sorted({c[0] for c in cells})
            depths = sorted({c[1] for c in cells})
            data = [[cells.get((n, d), float("nan")) for n in lengths] for d in depths]
            image = ax.imshow(data, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
            ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
            ax.set_yticks(range(len(depths)), [f"{d:g}%" for d in depths])
            ax.set_xlabel("prompt length (tokens)")
            ax.set_ylabel("needle depth")
            count = sum(
                1
                for r in records
                if r["type"] == "needle" and (r["press"], r.get("budget")) == (press, budget)
            )
            ax.set_title(f"{press} budget {budget_label(budget)} (n={count})", fontsize=10)
        if image is not None:
            fig.colorbar(image, ax=list(axes[0]), shrink=0.8, label="needle accuracy (share)")
        name = f"needle_heatmap_{press}.png"
        fig.savefig(out_dir / name, dpi=100)
        plt.close(fig)
        written.append(name)
    return written
