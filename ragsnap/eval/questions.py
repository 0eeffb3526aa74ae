"""The per-question view: each item's gold, every press x budget's answer, score and why.

report.md shows the first :data:`REPORT_ITEMS` items as collapsible ``<details>`` blocks;
``questions.md`` holds all of them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ragsnap.eval.explain import explain_score

REPORT_ITEMS = 20
QUESTIONS = "questions.md"
_SCORE_KEYS = ("accuracy", "list_f1", "rouge_l")


def _cell(text: Any, limit: int = 300) -> str:
    """Text fit for one markdown table cell: one line, pipes escaped, long text cut."""
    flat = " ".join(str(text).split()).replace("|", "\\|")
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def _size(record: dict[str, Any]) -> str:
    budget = record.get("budget")
    return "all" if budget is None else str(budget)


def _score(record: dict[str, Any]) -> str:
    for key in _SCORE_KEYS:
        value = record["scores"].get(key)
        if value is not None:
            return f"{key} {value:.3g}"
    return "-"


def _why(record: dict[str, Any]) -> str:
    """The stored explanation (older records: recomputed from the stored gold forms)."""
    if record.get("why"):
        return str(record["why"])
    gold = record.get("gold_answers") or []
    groups = [[g] for g in gold] if record["type"] == "list" else []
    return explain_score(record["type"], record["answer"], gold, groups)


def item_block(records: Sequence[dict[str, Any]]) -> list[str]:
    """One item's ``<details>`` block: question, gold answers, one table row per run."""
    first = records[0]
    question = " ".join(str(first["question"]).split())
    gold = "; ".join(str(g) for g in first.get("gold_answers") or []) or "-"
    lines = [
        "<details>",
        f"<summary><code>{first['item_id']}</code> ({first['type']}): "
        f"{_cell(question, 120)}</summary>",
        "",
        f"**Question:** {_cell(question, 2000)}",
        "",
        f"**Gold:** {_cell(gold, 1000)}",
        "",
        "| press | budget | score | answer | why |",
        "|---|---|---|---|---|",
    ]
    for r in records:
        lines.append(
            f"| {r['press']} | {_size(r)} | {_score(r)} | {_cell(r['answer'])} "
            f"| {_cell(_why(r), 400)} |"
        )
    return lines + ["", "</details>", ""]


def by_item(records: Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Records grouped per item (items in id order; the full cache first, then grid order)."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        groups[str(r["item_id"])].append(r)

    # stable sort: the full cache first, the others in the stored (grid) order
    return [sorted(groups[k], key=lambda r: r["press"] != "full") for k in sorted(groups)]


def question_section(out_dir: Path, records: Sequence[dict[str, Any]]) -> list[str]:
    """Write ``questions.md`` (every item) and return report.md's per-question section."""
    items = by_item(records)
    if not items:
        return []
    blocks = [line for group in items for line in item_block(group)]
    page = ["# ragsnap eval: every question", ""] + blocks
    (out_dir / QUESTIONS).write_text("\n".join(page), encoding="utf-8")
    shown = items[:REPORT_ITEMS]
    head = ["## Per question (answer, score and why)", ""]
    if len(items) > len(shown):
        head += [
            f"The first {len(shown)} of {len(items)} items; all are in [{QUESTIONS}]({QUESTIONS}).",
            "",
        ]
    return head + [line for group in shown for line in item_block(group)]
