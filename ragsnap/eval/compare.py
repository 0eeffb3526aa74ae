"""Two ``ragsnap eval`` output folders side by side: paired deltas and what settings differ.

Records pair by item id and press x budget. For each shared press x budget and each
per-item score both runs have, the comparison gives both means, the mean paired delta
(B - A) with its bootstrap 95% interval over items, the items where B is higher / lower,
and the exact two-sided sign test over those (:mod:`ragsnap.eval.confidence`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from statistics import fmean
from typing import Any

from ragsnap.errors import InputError
from ragsnap.eval.confidence import CI_SCORES, bootstrap_ci, paired_counts, sign_test
from ragsnap.eval.store import PREDICTIONS, SETTINGS, record_key

Key = tuple[str, str, Any]


def read_run(folder: Path) -> tuple[dict[Key, dict[str, Any]], dict[str, Any]]:
    """``(records by key, settings)`` of one output folder (settings {} when absent)."""
    path = folder / PREDICTIONS
    if not path.is_file():
        raise InputError(f"{folder}: no {PREDICTIONS} (not a ragsnap eval --out folder)")
    records: dict[Key, dict[str, Any]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by an interrupted run
        if isinstance(record, dict) and "item_id" in record:
            records[record_key(record)] = record
    settings_path = folder / SETTINGS
    try:
        settings = json.loads(settings_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        settings = {}
    return records, settings if isinstance(settings, dict) else {}


def _flat(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Dotted keys of nested objects; lists of objects (the press grid) by index."""
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        value = {str(i): v for i, v in enumerate(value)}
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from _flat(inner, f"{prefix}.{key}" if prefix else str(key))
    else:
        yield prefix, value


def settings_diff(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    """``[{"key", "a", "b"}]`` for every (dotted) setting whose values differ."""
    flat_a, flat_b = dict(_flat(a)), dict(_flat(b))
    keys = sorted(set(flat_a) | set(flat_b))
    return [
        {"key": k, "a": flat_a.get(k), "b": flat_b.get(k)}
        for k in keys
        if flat_a.get(k) != flat_b.get(k)
    ]


def _metric(pairs: list[tuple[float, float]]) -> dict[str, Any]:
    higher, lower = paired_counts([(b, a) for a, b in pairs])
    ci = bootstrap_ci([b - a for a, b in pairs])
    return {
        "n": len(pairs),
        "a": round(fmean(a for a, _ in pairs), 6),
        "b": round(fmean(b for _, b in pairs), 6),
        "delta": round(fmean(b - a for a, b in pairs), 6),
        "delta_ci": list(ci) if ci else None,
        "b_higher": higher,
        "b_lower": lower,
        "sign_p": sign_test(higher, lower),
    }


def compare_runs(run_a: Path, run_b: Path) -> dict[str, Any]:
    """The paired comparison of two output folders; InputError when they share no item."""
    records_a, settings_a = read_run(run_a)
    records_b, settings_b = read_run(run_b)
    shared = sorted(set(records_a) & set(records_b), key=lambda k: (k[1], str(k[2]), k[0]))
    if not shared:
        raise InputError(
            f"{run_a} and {run_b} share no item at the same press and budget: nothing to compare"
        )
    points: dict[tuple[str, Any], list[Key]] = {}
    for key in shared:
        points.setdefault((key[1], key[2]), []).append(key)
    rows = []
    for (press, budget), keys in points.items():
        metrics = {}
        for name in CI_SCORES:
            pairs = [
                (float(records_a[k]["scores"][name]), float(records_b[k]["scores"][name]))
                for k in keys
                if records_a[k]["scores"].get(name) is not None
                and records_b[k]["scores"].get(name) is not None
            ]
            if pairs:
                metrics[name] = _metric(pairs)
        rows.append({"press": press, "budget": budget, "n": len(keys), "metrics": metrics})
    items_a = {k[0] for k in records_a}
    items_b = {k[0] for k in records_b}
    return {
        "a": str(run_a),
        "b": str(run_b),
        "shared_items": len({k[0] for k in shared}),
        "only_a_items": len(items_a - items_b),
        "only_b_items": len(items_b - items_a),
        "points": rows,
        "settings_differ": settings_diff(settings_a, settings_b),
    }


def format_comparison(result: dict[str, Any]) -> list[str]:
    """The comparison as lines of text for the terminal."""
    lines = [
        f"A = {result['a']}",
        f"B = {result['b']}",
        f"{result['shared_items']} shared items ({result['only_a_items']} only in A, "
        f"{result['only_b_items']} only in B); delta = B - A, 95% bootstrap CI over items, "
        "p = exact two-sided sign test",
    ]
    for row in result["points"]:
        size = "all" if row["budget"] is None else row["budget"]
        lines.append(f"{row['press']} budget {size} (n={row['n']}):")
        for name, m in row["metrics"].items():
            ci = m["delta_ci"]
            shown_ci = f"[{ci[0]:+.4f}, {ci[1]:+.4f}]" if ci else "[-]"
            p = "-" if m["sign_p"] is None else f"{m['sign_p']:.3g}"
            lines.append(
                f"  {name:<16} A {m['a']:.4f}  B {m['b']:.4f}  delta {m['delta']:+.4f} "
                f"{shown_ci}  B higher/lower {m['b_higher']}/{m['b_lower']}  p {p}"
            )
    differ = result["settings_differ"]
    lines.append("settings that differ:" if differ else "settings: identical")
    for d in differ:
        lines.append(f"  {d['key']}: A {json.dumps(d['a'])}  B {json.dumps(d['b'])}")
    return lines
