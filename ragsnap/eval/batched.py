"""Greedy decoding and teacher forcing of several compressed caches as one batch.

Presses at the same budget keep the same number of entries per layer, so their caches
stack along the batch axis and decode together: one model call per step serves them all
(on a CPU the weights are read once per step whatever the batch). All rows share the
prompt positions and the first token's logits (prefill attention is full for every press).
Caches with a per-key attention bias are not stacked; the runner decodes those one by one.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ragsnap.generation import GenerationConfig
from ragsnap.kv import derive_cache


def layer_lengths(cache: Any) -> tuple[int, ...]:
    return tuple(int(layer.keys.shape[-2]) for layer in cache.layers)


def stack_caches(caches: Sequence[Any]) -> Any:
    """One cache whose batch rows are ``caches`` (same entries per layer): ``[k, Hkv, n, D]``."""
    stacked = copy.copy(caches[0])
    stacked.layers = []
    for i, layer in enumerate(caches[0].layers):
        clone = copy.copy(layer)
        clone.keys = torch.cat([c.layers[i].keys for c in caches], dim=0)
        clone.values = torch.cat([c.layers[i].values for c in caches], dim=0)
        stacked.layers.append(clone)
    return stacked


def _call(engine: Any, tokens: torch.Tensor, cache: Any, start: int, keep: int) -> torch.Tensor:
    """``tokens`` ``[k, n]`` at positions ``start..start+n-1`` -> logits ``[k, keep or n, V]``."""
    positions = torch.arange(start, start + tokens.shape[1], device=engine.device)
    with torch.inference_mode():
        out = engine.model(
            input_ids=tokens.to(engine.device),
            position_ids=positions.unsqueeze(0).expand(tokens.shape[0], -1),
            use_cache=True,
            logits_to_keep=keep,
            **{engine.loaded.cache_kwarg: cache},
        )
    return out.logits


def teacher_force_batch(
    engine: Any, stacked: Any, start: int, tokens: Sequence[int]
) -> torch.Tensor:
    """Log-probs ``[k, n, V]`` of every row along ``tokens`` (on a copy of ``stacked``)."""
    batch = stacked.layers[0].keys.shape[0]
    ids = torch.tensor([list(tokens)], dtype=torch.long).expand(batch, -1)
    cache = derive_cache(stacked)
    if len(set(layer_lengths(stacked))) == 1:
        logits = _call(engine, ids, cache, start, keep=0)
    else:
        # layers of different lengths (PyramidKV): transformers builds one causal mask for
        # all layers, which only fits a multi-token step when every layer has the same
        # length, so feed one token per step (as decoding does)
        logits = torch.cat(
            [
                _call(engine, ids[:, j : j + 1], cache, start + j, keep=1)
                for j in range(ids.shape[1])
            ],
            dim=1,
        )
    return torch.log_softmax(logits.float(), dim=-1).cpu()


def _keep_rows(cache: Any, rows: torch.Tensor) -> None:
    """Drop finished rows from a stacked cache in place (``rows``: indices to keep)."""
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(0, rows)
        layer.values = layer.values.index_select(0, rows)


def decode_batch(
    engine: Any,
    stacked: Any,
    first_logits: torch.Tensor,
    start: int,
    generation: GenerationConfig,
    should_stop: Callable[[list[int]], bool] | None = None,
) -> tuple[list[list[int]], float, int]:
    """Greedy answers of every row of ``stacked`` (stop tokens excluded).

    ``first_logits`` ``[1, V]`` are the prefill's next-token logits (the same for all rows).
    A row ends at a stop token, ``max_new_tokens`` or ``should_stop(row_tokens)``; finished
    rows leave the batch (``stacked`` shrinks with them). Returns the answers, decode seconds
    and model steps.
    """
    batch = stacked.layers[0].keys.shape[0]
    logits = first_logits.expand(batch, -1)
    answers: list[list[int]] = [[] for _ in range(batch)]
    active = list(range(batch))  # answer index of each remaining row of the cache
    seconds, steps, position = 0.0, 0, start
    for _ in range(generation.max_new_tokens):
        chosen = logits.argmax(-1).tolist()
        still: list[int] = []
        for row, token in enumerate(chosen):
            answer = answers[active[row]]
            if token in engine.stop_ids:
                continue
            answer.append(int(token))
            if len(answer) < generation.max_new_tokens and not (
                should_stop and should_stop(answer)
            ):
                still.append(row)
        if not still:
            break
        if len(still) < len(active):
            _keep_rows(stacked, torch.tensor(still, device=stacked.layers[0].keys.device))
            chosen = [chosen[row] for row in still]
            active = [active[row] for row in still]
        started = time.perf_counter()
        tokens = torch.tensor(chosen, dtype=torch.long).unsqueeze(1)
        logits = _call(engine, tokens, stacked, position, keep=1)[:, -1]
        seconds += time.perf_counter() - started
        steps += 1
        position += 1
    return answers, seconds, steps
