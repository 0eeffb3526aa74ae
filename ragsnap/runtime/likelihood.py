"""How likely the model finds a continuation: one short forward pass over a batch of
(prompt, target) token rows (issue 43: an answer sentence given its quote, against given
no document).

Rows are right-padded into one ``[B, T]`` batch and run without a cache. Under causal
attention a real token never sees the padding after it, so no attention mask is needed and
each row's log-probs are the ones it gets alone (up to float rounding).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ragsnap.runtime.loading.bf16_matmuls import medium_products


def target_logprobs(
    model: Any, rows: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int = 0
) -> list[torch.Tensor]:
    """The log-prob of each target token given everything before it, per row.

    Parameters
    ----------
    model:
        a causal LM (``model(input_ids=[B, T]).logits`` is ``[B, T, V]``).
    rows:
        ``(prompt_ids, target_ids)`` per row; the prompt holds at least one token and the
        target at least one.
    pad_id:
        the id written after a row's end (never read by that row).

    Returns
    -------
    One float32 CPU tensor ``[len(target_ids)]`` per row, in the order given.
    """
    if not rows:
        return []
    for i, (prompt, target) in enumerate(rows):
        if not prompt or not target:
            raise ValueError(f"row {i}: the prompt and the target must each hold a token")
    lengths = [len(p) + len(t) for p, t in rows]
    device = next(model.parameters()).device
    ids = torch.full((len(rows), max(lengths)), pad_id, dtype=torch.long)
    for r, (prompt, target) in enumerate(rows):
        ids[r, : lengths[r]] = torch.tensor([*prompt, *target], dtype=torch.long)
    # only the positions that predict a target token go through the output head (on a
    # short prompt the head over the vocabulary costs as much as the layers)
    first = min(len(p) for p, _ in rows) - 1
    with torch.inference_mode(), medium_products():
        out_ = model(input_ids=ids.to(device), use_cache=False, logits_to_keep=ids.shape[1] - first)
    logits = out_.logits  # [B, T - first, V]: position first + j at j
    out = []
    for r, (prompt, target) in enumerate(rows):
        start = len(prompt)
        # position j predicts token j + 1: the target's logits start one before it
        row = torch.log_softmax(logits[r, start - 1 - first : lengths[r] - 1 - first].float(), -1)
        picked = row.gather(1, torch.tensor(list(target), device=row.device).unsqueeze(1))
        out.append(picked.squeeze(1).cpu())
    return out


def mean_lift(
    model: Any,
    given: Sequence[Sequence[int]],
    alone: Sequence[Sequence[int]],
    targets: Sequence[Sequence[int]],
    pad_id: int = 0,
) -> torch.Tensor:
    """The mean per-token log-prob of ``targets[i]`` after ``given[i]`` minus after
    ``alone[i]``: ``[k]`` float32 (nats per token). One pass per condition, each a
    batch of the ``k`` rows (a positive lift: the prompt of ``given`` makes the target
    likelier)."""
    if not (len(given) == len(alone) == len(targets)):
        raise ValueError(f"{len(given)} / {len(alone)} / {len(targets)} prompts and targets")
    if not targets:
        return torch.empty(0)
    with_prompt = target_logprobs(model, list(zip(given, targets, strict=True)), pad_id)
    without = target_logprobs(model, list(zip(alone, targets, strict=True)), pad_id)
    return torch.stack([a.mean() - b.mean() for a, b in zip(with_prompt, without, strict=True)])
