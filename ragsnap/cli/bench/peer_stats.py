"""Figures of ``ragsnap bench peer``: per run, agreement between the servers, and ratios.

A run is one server answering one scenario's requests at one concurrency. Its
``answers_per_s`` is answered requests over the run's wall time; ``tokens_per_s`` all
generated tokens over it; ``decode_tokens_per_s_p50`` the median over requests of tokens
after the first over the time after the first token. Agreement compares ragsnap's answer
with the peer's (full KV cache, greedy) for the same request: normalized exact match and
token F1 (words normalized as the evaluation does: lowercase, no ``[n]`` markers,
punctuation or articles).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from statistics import median
from typing import Any

from ragsnap.cli.bench.peer_clients import Outcome


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q / 100 * len(ordered))))
    return round(ordered[rank - 1], 4)


def summarize_run(outcomes: Sequence[Outcome], wall_s: float) -> dict[str, Any]:
    answered = [o for o in outcomes if o.ok]
    ttfts = [o.ttft_s for o in answered if o.ttft_s is not None]
    decode = [r for o in answered if (r := o.decode_tokens_per_s) is not None]
    tokens = sum(o.new_tokens for o in answered)
    caches = Counter(o.cache for o in answered if o.cache is not None)
    summary: dict[str, Any] = {
        "requests": len(outcomes),
        "answered": len(answered),
        "wall_s": round(wall_s, 3),
        "answers_per_s": round(len(answered) / wall_s, 4) if wall_s > 0 else None,
        "ttft_s": {"p50": percentile(ttfts, 50), "p95": percentile(ttfts, 95)},
        "tokens_per_s": round(tokens / wall_s, 3) if wall_s > 0 else None,
        "decode_tokens_per_s_p50": round(median(decode), 3) if decode else None,
        "new_tokens": tokens,
        "prompt_tokens": sum(o.prompt_tokens or 0 for o in answered),
    }
    if caches:
        summary["cache"] = dict(sorted(caches.items()))
    stages = {k for o in answered for k in o.server_s}
    if stages:  # medians of the server's own timings: where the time goes
        summary["server_s_p50"] = {
            k: round(median(o.server_s[k] for o in answered if k in o.server_s), 4)
            for k in sorted(stages)
        }
    errors = [o.error for o in outcomes if o.error]
    if errors:
        summary["errors"] = errors[:3]
    return summary


def token_f1(prediction: str, reference: str) -> float:
    """Token-overlap F1 of normalized words (1.0 when both are empty)."""
    from ragsnap.eval.metrics import normalize_words

    a, b = normalize_words(prediction), normalize_words(reference)
    if not a and not b:
        return 1.0
    common = sum((Counter(a) & Counter(b)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(a), common / len(b)
    return 2 * precision * recall / (precision + recall)


def agreement(ours: Sequence[Outcome], peer: Sequence[Outcome]) -> dict[str, Any]:
    """How often ragsnap's answers match the peer's for the same requests (both answered)."""
    from ragsnap.eval.metrics import normalize

    theirs = {o.request_id: o for o in peer if o.ok}
    pairs = [(o, theirs[o.request_id]) for o in ours if o.ok and o.request_id in theirs]
    if not pairs:
        return {"pairs": 0, "exact_match": None, "token_f1": None}
    exact = sum(normalize(a.text) == normalize(b.text) for a, b in pairs)
    f1 = sum(token_f1(a.text, b.text) for a, b in pairs)
    same_prompt = sum(a.prompt_tokens == b.prompt_tokens for a, b in pairs)
    return {
        "pairs": len(pairs),
        "exact_match": round(exact / len(pairs), 4),
        "token_f1": round(f1 / len(pairs), 4),
        "same_prompt_tokens": same_prompt == len(pairs),
    }


def reference_accuracy(outcomes: Sequence[Outcome], requests: Sequence[Any]) -> float | None:
    """Share of answered requests with a reference answer whose answer contains one of them."""
    from ragsnap.eval.metrics import contains_any

    references = {r.id: r.reference for r in requests if r.reference}
    scored = [
        contains_any(o.text, references[o.request_id])
        for o in outcomes
        if o.ok and o.request_id in references
    ]
    return round(sum(scored) / len(scored), 4) if scored else None


def ratio(ours: float | None, theirs: float | None) -> float | None:
    return round(ours / theirs, 3) if ours is not None and theirs else None


def ratios(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, float | None]:
    """ragsnap over the peer: answers/s and tokens/s (above 1: ragsnap faster), TTFT p50
    and p95 (below 1: ragsnap sooner), peak memory where both were measured (below 1:
    ragsnap smaller)."""
    return {
        "answers_per_s": ratio(ours["answers_per_s"], theirs["answers_per_s"]),
        "tokens_per_s": ratio(ours["tokens_per_s"], theirs["tokens_per_s"]),
        "ttft_p50": ratio(ours["ttft_s"]["p50"], theirs["ttft_s"]["p50"]),
        "ttft_p95": ratio(ours["ttft_s"]["p95"], theirs["ttft_s"]["p95"]),
        "peak_memory": ratio(ours.get("peak_memory_mib"), theirs.get("peak_memory_mib")),
    }
