"""Attention an answer pays to the prompt, recomputed in one teacher-forced pass.

After decoding, the answer's tokens are fed once more over the prompt's (compressed)
cache as a single multi-token pass; the registered attention function hands each layer's
attention probabilities to an observer (``runtime.attention.observe_attention``), and the
probabilities on kept cache entries are mapped back to the original prompt positions the
press kept. Layers above the deepest one asked for are not run, and no logits are
computed: the pass stops after that layer. Citations use this as attention evidence.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ragsnap.runtime.attention import observe_attention
from ragsnap.runtime.forward import BatchedKV, forward_rows
from ragsnap.runtime.prefill import PrefillResult


class _DeepestLayerSeen(Exception):
    """Raised by the observer after the deepest wanted layer: the rest of the pass is moot."""


def kept_positions(prefill: PrefillResult, num_layers: int) -> dict[int, torch.Tensor]:
    """Per layer, the original prompt position of each cache entry, ``[Hkv, n_l]`` (CPU).

    Layers the press skipped (sliding windows) are absent unless the cache holds the
    whole prompt there, in which case entry ``i`` is position ``i``.
    """
    layers = prefill.layers
    out: dict[int, torch.Tensor] = {}
    if len(prefill.kept) == num_layers:
        for i, kept in enumerate(prefill.kept):
            out[i] = kept.indices[0].cpu()
        return out
    for i, (keys, _) in enumerate(layers):
        if keys.shape[-2] == prefill.original_length:
            out[i] = torch.arange(prefill.original_length).expand(keys.shape[1], -1)
    return out


@torch.inference_mode()
def answer_attention(
    model: Any,
    cache_kwarg: str,
    windows: list[int | None],
    prefill: PrefillResult,
    tokens: Sequence[int],
    layers: Sequence[int] | None = None,
) -> torch.Tensor:
    """Attention of each answer token's query on each prompt position: ``[n, L]`` float32 CPU.

    Row ``j`` is the query of ``tokens[j]`` (the one that predicted ``tokens[j + 1]``),
    averaged over query heads and over ``layers`` (all layers when None) among those
    whose kept positions are known; positions the press dropped get 0. ``L`` is the
    prompt's original length; the prefill is left unchanged.
    """
    length = prefill.original_length
    if not tokens:
        return torch.zeros(0, length)
    positions = kept_positions(prefill, len(windows))
    wanted = sorted(set(range(len(windows)) if layers is None else layers) & set(positions))
    total = torch.zeros(len(tokens), length)
    if not wanted:
        return total
    deepest = wanted[-1]

    def observe(layer: int, probs: torch.Tensor) -> None:
        if layer in positions and layer in wanted:
            index = positions[layer]  # [Hkv, n_l]
            group = probs.shape[1] // index.shape[0]
            n_l = index.shape[1]
            on_kept = probs[0, :, :, :n_l].cpu()  # [Hq, q, n_l]
            heads = index.repeat_interleave(group, dim=0)  # [Hq, n_l]
            spread = torch.zeros(on_kept.shape[0], on_kept.shape[1], length)
            spread.scatter_add_(2, heads.unsqueeze(1).expand_as(on_kept), on_kept)
            total.add_(spread.mean(dim=0))
        if layer >= deepest:
            raise _DeepestLayerSeen

    batch = BatchedKV(windows)
    batch.add(prefill.layers, length, prefill.bias, reserve=len(tokens))
    try:
        with observe_attention(observe):
            forward_rows(model, cache_kwarg, batch, [list(tokens)], last=True)
    except _DeepestLayerSeen:
        pass
    return total / len(wanted)
