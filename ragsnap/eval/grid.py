"""The grid of an evaluation: the full cache, then every press at every budget (or ratio)."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ragsnap.compression import PRESSES, Press, make_press
from ragsnap.errors import ConfigError

Size = int | float  # tokens kept per KV head (int) or, with --ratio, share of the prompt


@dataclass(frozen=True)
class GridPoint:
    """One press at one size: ``budget`` is tokens per KV head (int), or with ``--ratio`` the
    share of the prompt kept (float); None for the full cache."""

    press: str
    budget: Size | None
    instance: Press


def press_accepts(name: str, option: str) -> bool:
    """Whether press ``name`` takes ``option`` (``keep_instruction``, ``lookup`` and
    ``lookahead`` wrap any press)."""
    if option in ("keep_instruction", "lookup", "lookahead", "propagate_layer", "propagate_share"):
        return True
    factory = PRESSES.get(name)
    return factory is not None and option in inspect.signature(factory).parameters


def press_grid(
    names: Sequence[str],
    budgets: Sequence[int],
    *,
    ratios: Sequence[float] | None = None,
    options: dict[str, Any] | None = None,
) -> list[GridPoint]:
    """The full cache first (always: it is the reference), then each press at each budget
    (or each ratio, when ``ratios`` are given).

    ``options`` (window, kernel, pooling, profile, keep_instruction, lookup, lookahead; None =
    the press's default) go to every press that takes them; one that no chosen press takes
    is an error.
    Presses are looked up by registry name (:func:`make_press`), so presses added to
    ``ragsnap.compression.PRESSES`` later are selectable too.
    """
    sizes: list[Size] = list(ratios) if ratios else list(budgets)
    if not sizes:
        raise ConfigError("give at least one --budget", field="budget")
    chosen = [n for n in dict.fromkeys(n.strip() for n in names if n.strip()) if n != "full"]
    given = {k: v for k, v in (options or {}).items() if v is not None and v is not False}
    for key in given:
        if chosen and not any(press_accepts(n, key) for n in chosen if n in PRESSES):
            flag = "--layer-profile" if key == "profile" else f"--{key.replace('_', '-')}"
            raise ConfigError(
                f"{flag} is taken by none of the presses {', '.join(chosen)}", field=key
            )
    grid = [GridPoint("full", None, make_press("full"))]
    for name in chosen:
        taken = {k: v for k, v in given.items() if press_accepts(name, k)}
        for size in sizes:
            if ratios:
                if not 0 < size <= 1:
                    raise ConfigError(f"ratios must be in (0, 1], got {size}", field="ratio")
                instance = make_press(name, ratio=float(size), **taken)
            else:
                if size < 1:
                    raise ConfigError(f"budgets must be positive, got {size}", field="budget")
                instance = make_press(name, budget=int(size), **taken)
            grid.append(GridPoint(name, size, instance))
    return grid
