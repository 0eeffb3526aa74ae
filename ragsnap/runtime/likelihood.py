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
    # position j predicts token j + 1: a row's target is predicted from len(prompt) - 1 on
    where = [(r, j) for r, (p, t) in enumerate(rows) for j in range(len(p) - 1, lengths[r] - 1)]
    with torch.inference_mode(), medium_products():
        logits = _picked_logits(model, ids.to(device), where)  # [len(where), V]
    picked_ids = torch.tensor([t for _, target in rows for t in target], device=logits.device)
    scores = torch.log_softmax(logits.float(), -1).gather(1, picked_ids.unsqueeze(1)).squeeze(1)
    return list(scores.cpu().split([len(t) for _, t in rows]))


def _picked_logits(model: Any, ids: torch.Tensor, where: Sequence[tuple[int, int]]) -> Any:
    """The logits at the ``(row, position)`` pairs ``where`` of one pass over ``ids``.

    Only those positions go through the output head (over the vocabulary it costs as
    much as the layers on short rows): the decoder's hidden states are gathered first
    when the model exposes its decoder and head plainly; otherwise the head runs from the
    first picked position on."""
    rows = torch.tensor([r for r, _ in where], device=ids.device)
    cols = torch.tensor([j for _, j in where], device=ids.device)
    decoder = getattr(model, "model", None)
    head = getattr(model, "lm_head", None)
    plain = getattr(model.config, "final_logit_softcapping", None) is None
    if decoder is not None and head is not None and plain:
        hidden = decoder(input_ids=ids, use_cache=False).last_hidden_state
        return head(hidden[rows, cols])
    first = int(cols.min())
    logits = model(input_ids=ids, use_cache=False, logits_to_keep=ids.shape[1] - first).logits
    return logits[rows, cols - first]


def mean_lift(
    model: Any,
    given: Sequence[Sequence[int]],
    alone: Sequence[Sequence[int]],
    targets: Sequence[Sequence[int]],
    pad_id: int = 0,
) -> torch.Tensor:
    """The mean per-token log-prob of ``targets[i]`` after ``given[i]`` minus after
    ``alone[i]``: ``[k]`` float32 (nats per token). One pass over the ``2k`` rows of
    both conditions (a positive lift: the prompt of ``given`` makes the target
    likelier)."""
    if not (len(given) == len(alone) == len(targets)):
        raise ValueError(f"{len(given)} / {len(alone)} / {len(targets)} prompts and targets")
    if not targets:
        return torch.empty(0)
    # one pass over both conditions' rows (a pass has a fixed cost as large as its work)
    rows = list(zip(given, targets, strict=True)) + list(zip(alone, targets, strict=True))
    scored = target_logprobs(model, rows, pad_id)
    with_prompt, without = scored[: len(targets)], scored[len(targets) :]
    return torch.stack([a.mean() - b.mean() for a, b in zip(with_prompt, without, strict=True)])


def span_lifts(
    model: Any,
    given: Sequence[int],
    alone: Sequence[int],
    spans: Sequence[tuple[tuple[int, int], tuple[int, int]]],
    pad_id: int = 0,
) -> torch.Tensor:
    """For each ``((gs, ge), (as_, ae))`` of ``spans``: the mean log-prob of
    ``given[gs:ge]`` within the row ``given`` minus that of ``alone[as_:ae]`` within
    ``alone`` (the same tokens, read in two contexts): ``[len(spans)]`` float32, one pass
    over the two rows. A span must start after its row's first token.

    Reading several spans of one row costs one pass: the question, which both support
    prompts hold before the answer sentence, is scored beside the sentence for free."""
    where: list[tuple[int, int]] = []
    sizes: list[int] = []
    picked: list[int] = []
    for (gs, ge), (as_, ae) in spans:
        if not (0 < gs < ge <= len(given) and 0 < as_ < ae <= len(alone)):
            raise ValueError(f"span {(gs, ge)} / {(as_, ae)} outside its rows")
        if list(given[gs:ge]) != list(alone[as_:ae]):
            raise ValueError("a lift compares the same tokens in two contexts")
        for r, (start, end), row in ((0, (gs, ge), given), (1, (as_, ae), alone)):
            where += [(r, j - 1) for j in range(start, end)]
            picked += list(row[start:end])
            sizes.append(end - start)
    if not spans:
        return torch.empty(0)
    ids = torch.full((2, max(len(given), len(alone))), pad_id, dtype=torch.long)
    ids[0, : len(given)] = torch.tensor(list(given), dtype=torch.long)
    ids[1, : len(alone)] = torch.tensor(list(alone), dtype=torch.long)
    device = next(model.parameters()).device
    with torch.inference_mode(), medium_products():
        logits = _picked_logits(model, ids.to(device), where)
    target = torch.tensor(picked, device=logits.device).unsqueeze(1)
    scores = torch.log_softmax(logits.float(), -1).gather(1, target).squeeze(1).cpu()
    means = [part.mean() for part in scores.split(sizes)]
    return torch.stack([means[2 * i] - means[2 * i + 1] for i in range(len(spans))])
