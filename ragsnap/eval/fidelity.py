"""Fidelity to the full cache: teacher forcing a compressed cache along the full-cache answer.

The full cache's greedy answer ``a_1..a_n`` is fed to a cache after prefill, giving the
next-token distributions at the ``n`` positions after ``a_1``..``a_n`` (the last one
predicts what the full cache would produce next: end of turn, or the next token when
``max_new_tokens`` cut the answer). The distribution before ``a_1`` comes from the prefill
itself, which attends to the whole prompt whatever the press, so it is the same for every
press and is left out. KL(full || compressed) and the answer's negative log-likelihood
are averaged over those ``n`` positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ragsnap.kv import derive_cache


@dataclass
class Reference:
    """The full cache's teacher-forced view of its own answer.

    ``log_probs`` is ``[n, V]`` (float32), ``targets`` ``[n]``: the answer's next tokens,
    with the full cache's own greedy choice at the last position.
    """

    tokens: list[int]
    log_probs: torch.Tensor
    targets: torch.Tensor

    @property
    def nll(self) -> float:
        """Mean negative log-likelihood of the targets under the full cache."""
        return _mean_nll(self.log_probs, self.targets)


def _mean_nll(log_probs: torch.Tensor, targets: torch.Tensor) -> float:
    if targets.numel() == 0:
        return 0.0
    return float(-log_probs.gather(1, targets.unsqueeze(1)).mean())


def teacher_forced_log_probs(
    engine: Any, cache: Any, start: int, tokens: Sequence[int], bias: Any = None
) -> torch.Tensor:
    """Feed ``tokens`` at positions ``start..`` on a copy of ``cache``: log-probs ``[n, V]``.

    ``cache`` itself is left as it was (the copy shares its tensors and appends to its own
    layers), so one prefill serves several teacher-forced passes and decodes. ``bias`` is
    the prefill's per-kept-key logit bias (layer -> ``[1, Hkv, n]``), for presses that
    re-weight kept keys; it goes through the engine's own forward.
    """
    extra = {"bias": bias} if bias else {}
    if not tokens:
        return torch.empty(0, 0)
    copy = derive_cache(cache)
    if len({layer.keys.shape[-2] for layer in cache.layers}) == 1:
        logits = engine.forward_logits(list(tokens), copy, start, keep=0, **extra)  # [1, n, V]
    else:  # layers of different lengths: one token per step (see batched.teacher_force_batch)
        logits = torch.cat(
            [
                engine.forward_logits([t], copy, start + j, keep=1, **extra)
                for j, t in enumerate(tokens)
            ],
            dim=1,
        )
    return torch.log_softmax(logits[0].float(), dim=-1).cpu()


def full_reference(
    engine: Any, full_cache: Any, start: int, answer_tokens: Sequence[int]
) -> Reference:
    """Teacher-force the full cache along its own answer (``answer_tokens``, no stop token)."""
    tokens = list(answer_tokens)
    log_probs = teacher_forced_log_probs(engine, full_cache, start, tokens)
    if not tokens:
        return Reference(tokens, log_probs, torch.empty(0, dtype=torch.long))
    targets = torch.tensor(tokens[1:] + [int(log_probs[-1].argmax())], dtype=torch.long)
    return Reference(tokens, log_probs, targets)


def fidelity(
    engine: Any, cache: Any, start: int, reference: Reference, bias: Any = None
) -> dict[str, float | int]:
    """KL(full || compressed) and the NLL increase along the full-cache answer.

    Returns ``{"kl", "nll_gap", "fidelity_tokens"}`` (means over positions, nats; zeros when
    the full-cache answer is empty).
    """
    if not reference.tokens:
        return compare(torch.empty(0, 0), reference)
    log_probs = teacher_forced_log_probs(engine, cache, start, reference.tokens, bias)
    return compare(log_probs, reference)


def compare(compressed: torch.Tensor, reference: Reference) -> dict[str, float | int]:
    """:func:`fidelity` from a compressed cache's teacher-forced log-probs ``[n, V]``."""
    if not reference.tokens:
        return {"kl": 0.0, "nll_gap": 0.0, "fidelity_tokens": 0}
    full = reference.log_probs
    kl = (full.exp() * (full - compressed)).sum(-1).clamp_min(0.0).mean()
    gap = _mean_nll(compressed, reference.targets) - reference.nll
    return {"kl": float(kl), "nll_gap": gap, "fidelity_tokens": len(reference.tokens)}
