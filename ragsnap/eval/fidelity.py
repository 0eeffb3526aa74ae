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

import torch

from ragsnap.runtime.model_runtime import ModelRuntime
from ragsnap.runtime.prefill import PrefillResult


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


def full_reference(
    runtime: ModelRuntime, full: PrefillResult, answer_tokens: Sequence[int]
) -> Reference:
    """Teacher-force the full cache along its own answer (``answer_tokens``, no stop token)."""
    tokens = list(answer_tokens)
    if not tokens:
        return Reference(tokens, torch.empty(0, 0), torch.empty(0, dtype=torch.long))
    log_probs = runtime.teacher_force([full], tokens)[0]
    targets = torch.tensor(tokens[1:] + [int(log_probs[-1].argmax())], dtype=torch.long)
    return Reference(tokens, log_probs, targets)


def fidelities(
    runtime: ModelRuntime,
    prefills: Sequence[PrefillResult],
    reference: Reference,
    rows: int = 8,
) -> list[dict[str, float | int]]:
    """KL(full || compressed) and the NLL increase along the full-cache answer, per prefill.

    Up to ``rows`` prefills are teacher-forced together in one multi-token pass, whatever
    their layer lengths and biases (``rows`` bounds the batch's memory: each row is a copy). Each result is ``{"kl", "nll_gap", "fidelity_tokens"}`` (means
    over positions, nats; zeros when the full-cache answer is empty).
    """
    if not reference.tokens or not prefills:
        return [compare(torch.empty(0, 0), reference) for _ in prefills]
    out: list[dict[str, float | int]] = []
    for begin in range(0, len(prefills), rows):
        log_probs = runtime.teacher_force(prefills[begin : begin + rows], reference.tokens)
        out += [compare(row, reference) for row in log_probs]
    return out


def compare(compressed: torch.Tensor, reference: Reference) -> dict[str, float | int]:
    """:func:`fidelity` from a compressed cache's teacher-forced log-probs ``[n, V]``."""
    if not reference.tokens:
        return {"kl": 0.0, "nll_gap": 0.0, "fidelity_tokens": 0}
    full = reference.log_probs
    kl = (full.exp() * (full - compressed)).sum(-1).clamp_min(0.0).mean()
    gap = _mean_nll(compressed, reference.targets) - reference.nll
    return {"kl": float(kl), "nll_gap": gap, "fidelity_tokens": len(reference.tokens)}
