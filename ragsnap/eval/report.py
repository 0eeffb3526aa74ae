"""Writing the results: metrics.json, report.md and PNG plots (matplotlib, Agg backend)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ragsnap.eval.aggregate import needle_grid
from ragsnap.eval.items import Malformed

# report.md columns, in order; a column is shown when some run has the metric
COLUMNS = (
    ("accuracy", "accuracy"),
    ("yesno_accuracy", "yes/no acc"),
    ("yesno_macro_f1", "yes/no F1"),
    ("factoid_strict", "factoid strict"),
    ("factoid_lenient", "factoid lenient"),
    ("factoid_mrr", "factoid MRR"),
    ("list_f1", "list F1"),
    ("rouge_l", "ROUGE-L"),
    ("needle_accuracy", "needle acc"),
    ("needle_partial", "needle digits"),
    ("agreement", "agreement"),
    ("kl", "KL"),
    ("nll_gap", "NLL gap"),
    ("citation_precision", "cite P"),
    ("citation_recall", "cite R"),
    ("gold_kept_share", "gold kept"),
    ("needle_kept_share", "needle kept"),
)
HEADLINE = ("needle_accuracy", "accuracy", "factoid_lenient", "list_f1", "rouge_l")


def fmt(value: Any) -> str:
    """How report.md prints a number: three decimals, '-' when absent."""
    return "-" if value is None else f"{value:.3f}"


def budget_label(budget: int | None) -> str:
    return "all" if budget is None else str(budget)


def write_metrics(out_dir: Path, runs: list[dict[str, Any]]) -> Path:
    path = out_dir / "metrics.json"
    path.write_text(json.dumps({"runs": runs}, indent=2) + "\n", encoding="utf-8")
    return path


def write_malformed(out_dir: Path, malformed: Sequence[Malformed]) -> None:
    path = out_dir / "malformed.json"
    path.write_text(json.dumps([m.to_dict() for m in malformed], indent=2) + "\n", encoding="utf-8")


def _table(
    runs: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]], source: str
) -> list[str]:
    header = "| press | budget | n | " + " | ".join(label for _, label in columns) + " |"
    lines = [header, "|" + "---|" * (3 + len(columns))]
    for run in runs:
        values = run[source]
        cells = [fmt(values.get(key)) for key, _ in columns]
        lines.append(
            f"| {run['press']} | {budget_label(run['budget'])} | {run['n']} | "
            + " | ".join(cells)
            + " |"
        )
    return lines


def _pair(values: dict[str, Any], first: str, second: str) -> str:
    return f"{values[first]} / {values[second]}" if first in values else "-"


def _versus_table(runs: Sequence[dict[str, Any]]) -> list[str]:
    """Paired comparison with the baseline press at the same budget (empty when none ran)."""
    paired = [r for r in runs if "versus" in r]
    if not paired:
        return []
    baseline = paired[0]["versus"]["baseline"]
    lines = [
        f"## Against {baseline} at the same budget (paired items)",
        "",
        "| press | budget | n | KL ratio | KL lower / higher | accuracy won / lost "
        "| agreement won / lost |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in paired:
        v = run["versus"]
        lines.append(
            f"| {run['press']} | {budget_label(run['budget'])} | {v['n']} | "
            f"{fmt(v.get('kl_ratio'))} | {_pair(v, 'kl_lower', 'kl_higher')} "
            f"| {_pair(v, 'accuracy_won', 'accuracy_lost')} "
            f"| {_pair(v, 'agreement_won', 'agreement_lost')} |"
        )
    return lines + [""]


def write_report(
    out_dir: Path,
    runs: list[dict[str, Any]],
    records: Sequence[dict[str, Any]],
    header: dict[str, Any],
    malformed: Sequence[Malformed],
    plots: Sequence[str],
) -> Path:
    """``report.md``: settings, the metrics table, retention, needles by length, the paired
    comparison with the baseline press, timings."""
    lines = ["# ragsnap eval report", ""]
    lines += [f"- {key}: {value}" for key, value in header.items()]
    items = len({r["item_id"] for r in records})
    lines += [f"- items scored: {items}", f"- malformed items skipped: {len(malformed)}", ""]
    columns = [(k, label) for k, label in COLUMNS if any(k in r["metrics"] for r in runs)]
    lines += ["## Metrics", ""] + _table(runs, columns, "metrics") + [""]
    kept = [
        (k, label) for k, label in COLUMNS if any(r["retention"].get(k) is not None for r in runs)
    ]
    if kept:
        lines += ["## Retention (metric / full-cache metric on the same items)", ""]
        lines += _table(runs, kept, "retention") + [""]
    lengths = sorted(
        {
            key[len("needle_accuracy_length") :]
            for r in runs
            for key in r["metrics"]
            if key.startswith("needle_accuracy_length")
        },
        key=float,
    )
    if lengths:
        cols = [(f"needle_accuracy_length{n}", f"{n} tokens") for n in lengths]
        lines += ["## Needle accuracy by prompt length", ""] + _table(runs, cols, "metrics") + [""]
    lines += _versus_table(runs)
    timing_cols = [
        ("prefill_s", "prefill s (shared)"),
        ("compress_s", "compress s"),
        ("decode_ms_per_token", "decode ms/token"),
        ("fidelity_s", "teacher forcing s"),
    ]
    lines += ["## Timings (mean per item)", ""] + _table(runs, timing_cols, "timings") + [""]
    if malformed:
        lines += ["## Malformed items (skipped)", ""]
        lines += [f"- {m.where}: {m.reason}" for m in malformed[:50]]
        if len(malformed) > 50:
            lines.append(f"- ... and {len(malformed) - 50} more (malformed.json)")
        lines.append("")
    if plots:
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_scores(out_dir: Path, runs: Sequence[dict[str, Any]]) -> list[str]:
    """``score_vs_budget.png``: headline score, agreement and KL vs budget, one line per press."""
    headline = next((k for k in HEADLINE if any(k in r["metrics"] for r in runs)), None)
    panels = [k for k in (headline, "agreement", "kl") if k]
    budgets = sorted({r["budget"] for r in runs if r["budget"] is not None})
    if not budgets:
        return []
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    full = next((r for r in runs if r["press"] == "full"), None)
    for ax, key in zip(axes[0], panels, strict=True):
        for press in dict.fromkeys(r["press"] for r in runs if r["press"] != "full"):
            pts = [(r["budget"], r["metrics"].get(key)) for r in runs if r["press"] == press]
            pts = [(b, v) for b, v in pts if v is not None]
            if pts:
                ax.plot([b for b, _ in pts], [v for _, v in pts], marker="o", label=press)
        if full is not None and full["metrics"].get(key) is not None:
            ax.axhline(full["metrics"][key], color="black", linestyle="--", label="full")
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.set_xlabel("budget (tokens per KV head)")
        ax.set_title(key)
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
            ax.set_xlabel("prompt tokens")
            ax.set_ylabel("needle depth")
            ax.set_title(f"{press} budget {budget_label(budget)}")
        if image is not None:
            fig.colorbar(image, ax=list(axes[0]), shrink=0.8, label="accuracy")
        name = f"needle_heatmap_{press}.png"
        fig.savefig(out_dir / name, dpi=100)
        plt.close(fig)
        written.append(name)
    return written
