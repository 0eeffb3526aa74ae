"""Teacher forcing: several caches fed the same tokens in one multi-token pass.

Caches whose layers differ in length (profiled budgets, PyramidKV) or carry a per-key bias
batch together: each layer gets its own mask (see ``runtime.forward``), so the whole answer
goes through in one pass instead of one token per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ragsnap.runtime.forward import BatchedKV, forward_rows
from ragsnap.runtime.prefill import PrefillResult


def teacher_force(
    model: Any,
    cache_kwarg: str,
    windows: list[int | None],
    prefills: Sequence[PrefillResult],
    tokens: Sequence[int],
) -> torch.Tensor:
    """Log-probs ``[k, n, V]`` (float32, CPU) of each of the ``k`` prefills along ``tokens``.

    Position ``j`` predicts the token after ``tokens[j]``; the prefills are left unchanged.
    """
    if not tokens:
        return torch.empty(len(prefills), 0, 0)
    batch = BatchedKV(windows)
    for p in prefills:
        batch.add(p.layers, p.original_length, p.bias, reserve=len(tokens))
    logits = forward_rows(model, cache_kwarg, batch, [list(tokens)] * len(prefills), last=False)
    return torch.log_softmax(logits.float(), dim=-1).cpu()
