"""Which reused document tokens to recompute: by the question's attention to them.

CacheBlend ranks tokens by how far their reused KV deviates from a fresh computation at
an early layer (:func:`ragsnap.runtime.blend.deviation`). A query-aware alternative asks
the question instead: run the prompt's tail (the question and what follows it) once over
the assembled, not yet corrected, prefix and rank each document token by the attention
the tail pays it, summed over heads, tail tokens and layers. Those are the tokens the
answer reads and a window press keeps, so correcting them is where fidelity is bought.
The probe's own KV is discarded; the tail is prefilled again after the recompute. The
early variant sums the first layers only and stops the probe there: deviation from the
missing cross-document attention grows with depth, and the pass is a quarter as long.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ragsnap.runtime.attention import StepMask, observe_attention, step_masks
from ragsnap.runtime.kv import cache_from_layers

Layers = list[tuple[torch.Tensor, torch.Tensor]]


# the early probe's last layer: on the embedded model (30 layers) the tail's attention
# summed over layers 0-7 chose tokens as well as all 30 layers did on 6 held-out items
# (KL 0.320 vs 0.317 of plain concatenation's, share 0.15) for a quarter of the probe's
# pass, but worse on 24 evaluated items (0.58 vs 0.44 at 0.12; issue 44, lab/results.md
# "Reuse: accuracy, citations and selection")
EARLY_PROBE_LAYERS = 8


class _ProbeDone(Exception):
    """Raised once the last observed layer has been scored: the deeper layers are not run."""


@torch.inference_mode()
def _tail_attention(
    model: Any,
    cache_kwarg: str,
    layers: Layers,
    probe_ids: Sequence[int],
    hidden: torch.Tensor,
    depth: int,
) -> torch.Tensor:
    """``[P]`` float32: attention the tail ``probe_ids`` (at positions ``P ..``) pays each
    prefix position of ``layers`` (``[1, Hkv, P, D]`` per layer, left unchanged), summed
    over layers ``0 .. depth - 1``, query heads and tail tokens; the pass stops after
    layer ``depth - 1``. ``hidden`` (``[P]`` bool) marks positions whose KV is not filled
    yet: the probe does not see them and their score is 0."""
    device = layers[0][0].device
    length, q = int(layers[0][0].shape[2]), len(probe_ids)
    last = min(depth, len(layers)) - 1
    visible = torch.ones(q, length + q, dtype=torch.bool, device=device)
    visible[:, :length] &= ~hidden.to(device).view(1, -1)
    visible[:, length:] = torch.ones(q, q, dtype=torch.bool, device=device).tril()
    mask = torch.zeros(visible.shape, dtype=layers[0][0].dtype, device=device)
    mask = mask.masked_fill_(~visible, float("-inf")).view(1, 1, q, length + q)
    step = StepMask(mask, (length + q,))
    score = torch.zeros(length, dtype=torch.float32, device=device)

    def observe(layer: int, probs: torch.Tensor) -> None:  # probs [1, Hq, q, P + q]
        if layer <= last:
            score.add_(probs[0, :, :, :length].sum(dim=(0, 1)))
        if layer >= last and last < len(layers) - 1:
            raise _ProbeDone  # the deeper layers would only be thrown away

    cache = cache_from_layers(model.config, layers)  # the probe appends copies: layers intact
    positions = torch.arange(length, length + q, device=device).view(1, -1)
    try:
        with step_masks(dict.fromkeys(range(len(layers)), step)), observe_attention(observe):
            model(
                input_ids=torch.tensor([list(probe_ids)], device=device),
                position_ids=positions,
                use_cache=True,
                logits_to_keep=1,
                **{cache_kwarg: cache},
            )
    except _ProbeDone:
        pass
    return score.cpu()


def question_attention(
    model: Any,
    cache_kwarg: str,
    layers: Layers,
    probe_ids: Sequence[int],
    hidden: torch.Tensor,
) -> torch.Tensor:
    """``[P]`` float32: the tail's attention to each prefix position of ``layers``
    (``[1, Hkv, P, D]`` per layer), summed over every layer, query head and tail token
    (:func:`_tail_attention`; ``hidden`` ``[P]`` bool positions score 0)."""
    return _tail_attention(model, cache_kwarg, layers, probe_ids, hidden, len(layers))


def early_question_attention(
    model: Any,
    cache_kwarg: str,
    layers: Layers,
    probe_ids: Sequence[int],
    hidden: torch.Tensor,
) -> torch.Tensor:
    """``[P]`` float32: as :func:`question_attention`, summed over the first
    ``EARLY_PROBE_LAYERS`` layers only; the probe's pass stops there (ProphetKV, arXiv
    2602.02579, ranks by the query's attention at an early layer)."""
    return _tail_attention(model, cache_kwarg, layers, probe_ids, hidden, EARLY_PROBE_LAYERS)
