"""The output folder: predictions appended as JSON lines (what makes a run resumable) and
the settings the predictions depend on (a rerun with other settings is refused)."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ragsnap.errors import ConfigError

logger = logging.getLogger(__name__)

PREDICTIONS = "predictions.jsonl"
SETTINGS = "settings.json"


def record_key(record: dict[str, Any]) -> tuple[str, str, float | None]:
    """``(item_id, press, budget)``: one line of predictions.jsonl per key."""
    return str(record["item_id"]), str(record["press"]), record.get("budget")


class PredictionStore:
    """``DIR/predictions.jsonl``: one JSON object per item x press x budget.

    Opening the store repairs a last line cut short by an interrupted run (it is dropped)
    and remembers which keys are done.
    """

    def __init__(self, out_dir: Path) -> None:
        self.path = out_dir / PREDICTIONS
        self.done: set[tuple[str, str, float | None]] = set()
        self._repair()
        for record in self.records():
            self.done.add(record_key(record))

    def _repair(self) -> None:
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            cut = data.rfind(b"\n") + 1
            logger.warning("dropping an unfinished last line of %s", self.path)
            with self.path.open("r+b") as handle:
                handle.truncate(cut)

    def records(self) -> list[dict[str, Any]]:
        """Every stored record (unreadable lines are skipped with a warning)."""
        if not self.path.exists():
            return []
        out = []
        with self.path.open(encoding="utf-8") as handle:
            for lineno, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    logger.warning("%s:%d is not valid JSON; ignored", self.path, lineno)
        return out

    def append(self, records: Iterable[dict[str, Any]]) -> None:
        """Append one item's records at once, flushed to disk."""
        lines = [json.dumps(r, ensure_ascii=False) + "\n" for r in records]
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write("".join(lines))
            handle.flush()
            os.fsync(handle.fileno())
        for line in lines:
            self.done.add(record_key(json.loads(line)))


def check_settings(
    out_dir: Path, settings: dict[str, Any], extra: dict[str, Any] | None = None
) -> None:
    """Write ``settings`` (and ``extra``, e.g. provenance, never compared) to
    ``DIR/settings.json``, or refuse when the folder already holds predictions made with
    different settings (presses, budgets and --limit may change)."""
    path = out_dir / SETTINGS
    if path.exists():
        try:
            previous = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            previous = None
        if isinstance(previous, dict):
            changed = sorted(
                k
                for k in settings
                if k in previous and k not in (extra or {}) and previous[k] != settings[k]
            )
            if changed and (out_dir / PREDICTIONS).exists():
                raise ConfigError(
                    f"{out_dir} holds predictions made with other settings ({', '.join(changed)} "
                    "differ); use another --out or the same settings",
                    field=changed[0],
                )
    path.write_text(json.dumps({**settings, **(extra or {})}, indent=2) + "\n", encoding="utf-8")
