"""Calibrating query-aware prefill: the split layer ``s`` and the propagated share ``p``.

For each held-out item: the full cache is the reference (its greedy answer, teacher-forced);
the base press on the full path and the base press propagating at every ``(s, p)`` of a
grid are teacher-forced along that answer and scored by KL(full || variant)
(:mod:`ragsnap.eval.fidelity`). The chosen point is the cheapest one, by the share of layer
work it does (``s / L + p (1 - s / L)``), whose mean KL is at most ``tolerance`` times the
full-path press's (1.25 by default, issue 39's quality bar).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from ragsnap.compression.base import Press
from ragsnap.compression.full import FullPress
from ragsnap.compression.layer_budgets import model_fingerprint
from ragsnap.compression.propagate import PropagatePress
from ragsnap.eval.fidelity import fidelities, full_reference
from ragsnap.eval.items import EvalItem
from ragsnap.prompt.focus import prompt_focus
from ragsnap.prompt.structure import prompt_roles
from ragsnap.runtime.generation import GenerationConfig
from ragsnap.runtime.model_runtime import ModelRuntime

TOLERANCE = 1.25


def layer_work(layer: int, share: float, num_layers: int) -> float:
    """Share of a full prefill's layer work done by propagating ``share`` past ``layer``."""
    return layer / num_layers + share * (1 - layer / num_layers)


@dataclass
class PropagationCalibration:
    """What a sweep measured and chose (the packaged JSON for one model)."""

    model: str  # model_fingerprint
    layer: int
    share: float
    budget: int
    base_press: str
    base_kl: float  # mean KL of the base press on the full path
    kl: float  # mean KL at (layer, share)
    items: list[str] = field(default_factory=list)
    sweep: list[dict[str, float]] = field(default_factory=list)  # per grid point
    source: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"


def item_kls(
    runtime: ModelRuntime,
    item: EvalItem,
    generation: GenerationConfig,
    base: Press,
    grid: Sequence[tuple[int, float]],
) -> tuple[float, list[float], list[float]]:
    """KL of ``base`` on the full path, and per grid point its KL and prefill seconds."""
    layout = item.prompt(runtime, generation.max_new_tokens)
    roles = prompt_roles(runtime.tokenizer, layout)
    focus = prompt_focus(runtime.tokenizer, layout)
    full = runtime.prefill_prompt(layout, FullPress())
    reference = full_reference(runtime, full, runtime.generate(full, generation))
    prefills = [runtime.prefill_prompt(layout, base, roles=roles, focus=focus)]
    seconds = []
    for layer, share in grid:
        started = time.perf_counter()
        press = PropagatePress(base=base, layer=layer, share=share)
        prefills.append(runtime.prefill_prompt(layout, press, roles=roles, focus=focus))
        seconds.append(time.perf_counter() - started)
    kls = [float(f["kl"]) for f in fidelities(runtime, prefills, reference, rows=4)]
    return kls[0], kls[1:], seconds


def calibrate_propagation(
    runtime: ModelRuntime,
    items: Sequence[EvalItem],
    generation: GenerationConfig,
    base: Press,
    base_name: str,
    budget: int,
    grid: Sequence[tuple[int, float]],
    *,
    tolerance: float = TOLERANCE,
    source: str = "",
    progress: Callable[[EvalItem], None] | None = None,
) -> PropagationCalibration:
    """Sweep ``grid`` over ``items`` and choose ``(s, p)`` (see the module docstring); where
    no point holds the tolerance, the one with the lowest KL."""
    num_layers = int(runtime.loaded.model.config.num_hidden_layers)
    base_kls: list[float] = []
    kls: list[list[float]] = [[] for _ in grid]
    times: list[list[float]] = [[] for _ in grid]
    for item in items:
        base_kl, point_kls, seconds = item_kls(runtime, item, generation, base, grid)
        base_kls.append(base_kl)
        for i, (kl, s) in enumerate(zip(point_kls, seconds, strict=True)):
            kls[i].append(kl)
            times[i].append(s)
        if progress is not None:
            progress(item)
    base_mean = statistics.fmean(base_kls)
    sweep = [
        {
            "layer": layer,
            "share": share,
            "work": round(layer_work(layer, share, num_layers), 4),
            "kl": statistics.fmean(k),
            "kl_ratio": statistics.fmean(k) / base_mean if base_mean > 0 else float("inf"),
            "prefill_s": statistics.median(t),
        }
        for (layer, share), k, t in zip(grid, kls, times, strict=True)
    ]
    holding = [p for p in sweep if p["kl"] <= tolerance * base_mean]
    best = (
        min(holding, key=lambda p: (p["work"], p["kl"]))
        if holding
        else min(sweep, key=lambda p: p["kl"])
    )
    return PropagationCalibration(
        model=model_fingerprint(runtime.loaded.model.config),
        layer=int(best["layer"]),
        share=float(best["share"]),
        budget=budget,
        base_press=base_name,
        base_kl=base_mean,
        kl=float(best["kl"]),
        items=[item.id for item in items],
        sweep=sweep,
        source=source,
    )
