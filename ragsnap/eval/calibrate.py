"""Layer sensitivity: how much each layer alone, compressed by SnapKV, moves the answer.

For each calibration item: one prefill serves the full cache and ``num_layers`` variants
that compress a single layer; each variant is teacher-forced along the full cache's
greedy answer and scored by KL(full || variant) (see ``ragsnap.eval.fidelity``). The
per-layer means make a :class:`~ragsnap.compression.layer_budgets.LayerProfile`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ragsnap.compression.base import CompressedLayer, LayerContext, Press
from ragsnap.compression.full import FullPress
from ragsnap.compression.layer_budgets import LayerProfile, model_fingerprint
from ragsnap.compression.snapkv import SnapKVPress
from ragsnap.errors import ConfigError
from ragsnap.eval.fidelity import fidelities, full_reference
from ragsnap.eval.items import EvalItem
from ragsnap.runtime.generation import GenerationConfig
from ragsnap.runtime.model_runtime import ModelRuntime


@dataclass
class SingleLayerPress(Press):
    """Apply ``base`` to layer ``layer`` only; every other layer stays whole (no copy)."""

    name = "single-layer"
    base: Press
    layer: int

    def compress(self, layer: LayerContext) -> CompressedLayer:
        if layer.layer_idx == self.layer:
            return self.base.compress(layer)
        batch, heads = layer.keys.shape[:2]
        positions = torch.arange(layer.seq_len, device=layer.keys.device)
        return CompressedLayer(
            indices=positions.expand(batch, heads, -1), keys=layer.keys, values=layer.values
        )


def item_layer_kl(
    runtime: ModelRuntime, item: EvalItem, generation: GenerationConfig, budget: int
) -> list[float]:
    """``[num_layers]`` KL(full || only layer l compressed to ``budget``) for one item."""
    layout = item.prompt(runtime, generation.max_new_tokens)
    num_layers = runtime.loaded.model.config.num_hidden_layers
    presses: list[Press] = [FullPress()] + [
        SingleLayerPress(base=SnapKVPress(budget=budget), layer=i) for i in range(num_layers)
    ]
    full, *variants = runtime.prefill_many(layout.input_ids, presses)
    reference = full_reference(runtime, full, runtime.generate(full, generation))
    return [float(f["kl"]) for f in fidelities(runtime, variants, reference, rows=4)]


def calibrate_layers(
    runtime: ModelRuntime,
    items: Sequence[EvalItem],
    generation: GenerationConfig,
    budget: int,
    *,
    previous: LayerProfile | None = None,
    source: str = "",
    progress: Callable[[EvalItem], None] | None = None,
) -> LayerProfile:
    """Measure the per-layer sensitivity over ``items`` (merged with ``previous``, item-weighted).

    Items already in ``previous`` are skipped, so an interrupted or extended calibration
    resumes.
    """
    fingerprint = model_fingerprint(runtime.loaded.model.config)
    done: list[str] = []
    sums = [0.0] * runtime.loaded.model.config.num_hidden_layers
    if previous is not None:
        if previous.model != fingerprint or previous.budget != budget:
            raise ConfigError(
                f"the existing profile is for {previous.model} at budget {previous.budget}, "
                f"not {fingerprint} at {budget}"
            )
        done = list(previous.items)
        sums = [s * len(done) for s in previous.sensitivity]
        source = "; ".join(filter(None, (previous.source, source)))
    for item in items:
        if item.id in done:
            continue
        for layer, kl in enumerate(item_layer_kl(runtime, item, generation, budget)):
            sums[layer] += kl
        done.append(item.id)
        if progress is not None:
            progress(item)
    if not done:
        raise ConfigError("no calibration items (check --skip and --limit)", field="limit")
    return LayerProfile(
        model=fingerprint,
        sensitivity=tuple(s / len(done) for s in sums),
        budget=budget,
        items=tuple(done),
        source=source,
    )
