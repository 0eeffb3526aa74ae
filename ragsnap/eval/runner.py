"""The evaluation loop: every item through one shared prefill, every press x budget from it.

Per item: assemble the prompt, prefill once with every press recording its selection
(:meth:`ModelRuntime.prefill_many`), decode the full cache and every compressed cache as
rows of one batch, teacher-force the full cache along its answer (the reference, reused
across budgets), then the compressed caches in one multi-token pass. A press that kept
every position reuses the full-cache answer.
Items already in ``predictions.jsonl`` are skipped; an item that cannot run is reported
and skipped.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ragsnap.citations import extract_citations
from ragsnap.compression.decode_snapkv import DecodeSnapKV
from ragsnap.compression.lookup_focus import uses_focus
from ragsnap.errors import RagSnapError
from ragsnap.eval.citation_eval import citation_methods
from ragsnap.eval.explain import explain_score
from ragsnap.eval.fidelity import fidelities, full_reference
from ragsnap.eval.grid import GridPoint, press_grid
from ragsnap.eval.items import EvalItem, Malformed
from ragsnap.eval.metrics import kept_share, normalize, score_answer
from ragsnap.eval.store import PredictionStore
from ragsnap.prompt.assembly import (
    DocumentOrder,
    PromptLayout,
    encode_user_text_with_offsets,
    format_document,
)
from ragsnap.prompt.focus import prompt_focus
from ragsnap.prompt.structure import prompt_roles
from ragsnap.runtime.generation import GenerationConfig
from ragsnap.runtime.model_runtime import ModelRuntime

__all__ = ["EvalOutcome", "GridPoint", "evaluate_item", "press_grid", "run_items"]

logger = logging.getLogger(__name__)
_NUMBER_DONE = re.compile(r"\d[^\d]")


@dataclass
class EvalOutcome:
    """What a run did: items evaluated now, skipped as done, and reported as malformed."""

    evaluated: int = 0
    resumed: int = 0
    malformed: list[Malformed] = field(default_factory=list)


def evidence_token_spans(
    tokenizer: Any, layout: PromptLayout, item: EvalItem, span_key: str
) -> list[tuple[int, int]]:
    """Prompt token span of a character span inside one document (``item.metadata``:
    ``evidence_doc_id`` and ``span_key`` = ``[start, end)`` in that document's text)."""
    doc_id, chars = item.metadata.get("evidence_doc_id"), item.metadata.get(span_key)
    for index, doc in enumerate(layout.documents):
        if doc.id != doc_id or not chars:
            continue
        piece = format_document(index + 1, doc)
        offset = (
            len(f"[{index + 1}] {doc.title}".rstrip())
            + 1
            + (len(doc.text) - len(doc.text.lstrip()))
        )
        lo, hi = offset + chars[0], offset + chars[1]
        _, offsets = encode_user_text_with_offsets(tokenizer, piece)
        hit = [j for j, (s, e) in enumerate(offsets) if s < hi and e > lo]
        start, end = layout.doc_spans[index]
        if hit:
            return [(start + hit[0], min(start + hit[-1] + 1, end))]
    return []


def answer_stopper(item: EvalItem, tokenizer: Any) -> Callable[[list[int]], bool] | None:
    """Needle answers end with the number: stop once a digit run is followed by anything."""
    if item.type != "needle":
        return None
    return lambda tokens: bool(
        _NUMBER_DONE.search(tokenizer.decode(tokens, skip_special_tokens=True))
    )


@dataclass
class _Decoded:
    tokens: list[int]
    fidelity: dict[str, Any]
    decode_s: float
    steps: int
    fidelity_s: float
    batch: int


def _decode_rows(
    runtime: ModelRuntime,
    prefills: Sequence[Any],
    generation: GenerationConfig,
    stop: Any,
    decode: DecodeSnapKV | None = None,
) -> list[tuple[list[int], float, int]]:
    """Greedy answers of every prefill as rows of one batch: ``(tokens, decode_s, steps)``.

    ``decode`` (decode-phase SnapKV) applies to every row but the first (the full cache)."""
    batch = runtime.decode_batch()
    rows = [
        batch.add(i, p, generation, stop, decode_compression=decode if i else None)
        for i, p in enumerate(prefills)
    ]
    for _ in batch.run():
        pass
    return [(r.tokens, r.decode_s, r.steps) for r in rows]


def evaluate_item(
    runtime: ModelRuntime,
    item: EvalItem,
    grid: Sequence[GridPoint],
    generation: GenerationConfig,
    dataset: str,
    decode: DecodeSnapKV | None = None,
    order: DocumentOrder = "relevance",
) -> list[dict[str, Any]]:
    """Records (one per grid point) for ``item``; raises RagSnapError when it cannot run.

    With ``decode``, compressed caches also re-select while decoding; their answers show
    it, their teacher-forced fidelity (over the prompt's cache) does not."""
    layout = item.prompt(runtime, generation.max_new_tokens, order)
    length = layout.num_tokens
    roles = prompt_roles(runtime.tokenizer, layout)
    presses = [g.instance for g in grid]
    focus = prompt_focus(runtime.tokenizer, layout) if uses_focus(*presses) else None
    results = runtime.prefill_many(
        layout.input_ids, presses, roles=roles, focus=focus, layout=layout
    )
    stop = answer_stopper(item, runtime.tokenizer)
    compressed = [
        i
        for i, result in enumerate(results[1:], start=1)
        if not all(n == length for n in result.kept_tokens_per_layer)
    ]
    # the full cache and every compressed cache decode together: one model call per step
    answers = _decode_rows(
        runtime, [results[0]] + [results[i] for i in compressed], generation, stop, decode
    )
    full_tokens, full_s, full_steps = answers[0]
    started = time.perf_counter()
    reference = full_reference(runtime, results[0], full_tokens)
    exact = {"kl": 0.0, "nll_gap": 0.0, "fidelity_tokens": len(full_tokens)}
    batch = 1 + len(compressed)
    decoded = {0: _Decoded(full_tokens, exact, full_s, full_steps, 0.0, batch)}
    decoded[0].fidelity_s = time.perf_counter() - started
    for i in range(1, len(results)):
        if i not in compressed:  # the press kept everything: the full cache's answer
            decoded[i] = _Decoded(full_tokens, dict(exact), 0.0, 0, 0.0, 0)
    if compressed:
        started = time.perf_counter()
        fids = fidelities(runtime, [results[i] for i in compressed], reference)
        fid_s = (time.perf_counter() - started) / len(compressed)
        for i, fid, (tokens, seconds, steps) in zip(compressed, fids, answers[1:], strict=True):
            decoded[i] = _Decoded(tokens, fid, seconds, steps, fid_s, batch)
    text = runtime.tokenizer.decode
    full_answer = text(full_tokens, skip_special_tokens=True)
    in_prompt = {d.id for d in layout.documents}
    gold = [g for g in item.gold_doc_ids if g in in_prompt]
    gold_spans = [
        span
        for d, span in zip(layout.documents, layout.doc_spans, strict=True)
        if d.id in set(gold)
    ]
    value_spans = evidence_token_spans(runtime.tokenizer, layout, item, "value_span")
    records = []
    for i, (point, result) in enumerate(zip(grid, results, strict=True)):
        out = decoded[i]
        answer = text(out.tokens, skip_special_tokens=True)
        keep_rate = result.keep_rate().tolist()
        citations = extract_citations(answer, layout.documents)  # the model's own markers
        scores = score_answer(item.type, answer, item.answers, item.answer_groups)
        cite_scores, cite_detail, attribution_s = citation_methods(
            runtime,
            layout,
            item.question,
            result,
            out.tokens,
            gold,
            scores.get("accuracy"),
            evidence_spans=item.metadata.get("evidence_spans"),
            answers=item.answers if item.type in ("factoid", "short") else (),
        )
        scores.update(cite_scores)
        # the report's citation columns: the attribution ragsnap serves (the model's own
        # markers stay as cite_markers_*)
        scores["citation_precision"] = cite_scores["cite_combined_precision"]
        scores["citation_recall"] = cite_scores["cite_combined_recall"]
        scores["agreement"] = float(normalize(answer) == normalize(full_answer))
        scores["kl"], scores["nll_gap"] = out.fidelity["kl"], out.fidelity["nll_gap"]
        scores["gold_kept_share"] = kept_share(keep_rate, gold_spans)
        if value_spans:
            scores["needle_kept_share"] = kept_share(keep_rate, value_spans)
        records.append(
            {
                "item_id": item.id,
                "dataset": dataset,
                "type": item.type,
                "press": point.press,
                "budget": point.budget,
                "press_config": result.press_config,
                "question": item.question,
                "prompt_tokens": length,
                "kept_tokens": result.kept_tokens,
                "answer": answer,
                "full_answer": full_answer,
                "gold_answers": item.answers or [g[0] for g in item.answer_groups],
                "why": explain_score(item.type, answer, item.answers, item.answer_groups),
                "citations": [c.doc_id for c in citations],
                "attribution": cite_detail,
                "gold_doc_ids": gold,
                "scores": scores,
                "fidelity_tokens": out.fidelity["fidelity_tokens"],
                "stats": {
                    "prefill_s": round(result.prefill_s, 4),
                    "compress_s": round(result.compress_s, 4),
                    "decode_s": round(out.decode_s, 4),
                    "decode_ms_per_token": round(1000 * out.decode_s / out.steps, 3)
                    if out.steps
                    else None,
                    "decode_batch": out.batch,
                    "new_tokens": len(out.tokens),
                    "fidelity_s": round(out.fidelity_s, 4),
                    "attribution_s": round(attribution_s, 4),
                    "attribution_share": round(attribution_s / out.decode_s, 4)
                    if out.decode_s
                    else None,
                    "kv_bytes_full": result.kv_bytes_full,
                    "kv_bytes_kept": result.kv_bytes_kept,
                    "reused_full": out.batch == 0,
                },
                "meta": {
                    k: v
                    for k, v in item.metadata.items()
                    if k in ("length", "depth", "sample", "key", "structure", "records")
                },
            }
        )
    return records


def run_items(
    runtime: ModelRuntime,
    items: Sequence[EvalItem],
    grid: Sequence[GridPoint],
    store: PredictionStore,
    generation: GenerationConfig,
    *,
    dataset: str,
    progress: bool = True,
    decode: DecodeSnapKV | None = None,
    order: DocumentOrder = "relevance",
) -> EvalOutcome:
    """Evaluate every item not yet complete in ``store`` (with a tqdm bar and ETA)."""
    from tqdm import tqdm

    outcome = EvalOutcome()
    seen: set[str] = set()
    todo: list[EvalItem] = []
    for item in items:
        if item.id in seen:
            outcome.malformed.append(Malformed(item.id, "duplicate item id"))
            continue
        seen.add(item.id)
        if all((item.id, g.press, g.budget) in store.done for g in grid):
            outcome.resumed += 1
        else:
            todo.append(item)
    if outcome.resumed:
        logger.info("resuming: %d items already done", outcome.resumed)
    with tqdm(
        total=len(todo), desc="ragsnap eval", unit="item", disable=not progress, dynamic_ncols=True
    ) as bar:
        for item in todo:
            bar.set_postfix_str(item.id[:24])
            try:
                records = evaluate_item(runtime, item, grid, generation, dataset, decode, order)
            except RagSnapError as exc:
                logger.warning("item %s skipped: %s", item.id, exc)
                outcome.malformed.append(Malformed(item.id, str(exc)))
            else:
                store.append(
                    r for r in records if (r["item_id"], r["press"], r["budget"]) not in store.done
                )
                outcome.evaluated += 1
            bar.update(1)
    return outcome


def select_records(
    records: Sequence[dict[str, Any]], items: Sequence[EvalItem], grid: Sequence[GridPoint]
) -> list[dict[str, Any]]:
    """The stored records that belong to this run's items and grid (last write wins)."""
    wanted_items = {i.id for i in items}
    wanted_points = {(g.press, g.budget) for g in grid}
    chosen: dict[tuple[str, str, float | None], dict[str, Any]] = {}
    for r in records:
        if r["item_id"] in wanted_items and (r["press"], r.get("budget")) in wanted_points:
            chosen[(r["item_id"], r["press"], r.get("budget"))] = r
    return list(chosen.values())


def output_dir(path: str | Path) -> Path:
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    return out
