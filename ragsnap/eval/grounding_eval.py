"""Grounded against correct (issue 43): the claim-level verdict on answerable items and on
the same items with their gold documents removed (padded back with other items'
documents to the same prompt length), so the documents do not answer them.

``python -m ragsnap.eval.grounding_eval --format hotpotqa --data PATH -n 50`` prints one
JSON object: per set, answerable accuracy, the share of right answers that are grounded,
the share of unanswerable answers that are not grounded (what ``abstain`` would replace),
the accuracy ``abstain`` would keep, and the check's time against the answer's.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ragsnap.citations.sentences import Sentence
from ragsnap.citations.support import check_sentence
from ragsnap.citations.verdict import grounding
from ragsnap.engine.events import DoneEvent
from ragsnap.eval.items import EvalItem
from ragsnap.eval.metrics import contains_any
from ragsnap.prompt.documents import Document


def without_gold(
    item: EvalItem, pool: Sequence[Document], count_tokens: Any, seed: int = 0
) -> EvalItem:
    """``item`` with its gold documents replaced by documents of other items (none of its
    own, none whose text holds an answer) until the prompt is as long as before."""
    gold = set(item.gold_doc_ids)
    kept = [d for d in item.documents if d.id not in gold]
    target = sum(count_tokens(d.text) for d in item.documents)
    used = sum(count_tokens(d.text) for d in kept)
    own = {d.id for d in item.documents}
    rng = random.Random(f"{seed}:{item.id}")
    candidates = [d for d in pool if d.id not in own and not contains_any(d.text, item.answers)]
    rng.shuffle(candidates)
    for doc in candidates:
        if used >= target:
            break
        kept.append(doc)
        used += count_tokens(doc.text)
    rng.shuffle(kept)
    return EvalItem(
        id=f"{item.id}:unanswerable",
        question=item.question,
        documents=kept,
        type=item.type,
        answers=item.answers,
        gold_doc_ids=[],
    )


def check_seconds(done: DoneEvent, question: str, documents: Sequence[Document]) -> float:
    """The time of the claim-level work on ``done`` again: each cited sentence against its
    citation's quotes and document, then the verdict (what the engine adds per answer)."""
    answer = done.model_answer if done.model_answer is not None else done.answer
    started = time.perf_counter()
    for citation in done.citations:
        doc = documents[citation.index - 1]
        quotes = [q.text for q in citation.quotes] + [doc.title]
        for start, end in citation.spans:
            check_sentence(Sentence(answer[start:end], start, end), quotes, [doc.text], question)
    grounding(answer, done.citations)
    return time.perf_counter() - started


def run_items(engine: Any, items: Sequence[EvalItem], budget: int, max_new_tokens: int) -> list:
    """One row per item: correct, grounded, score and timings."""
    from ragsnap.compression import make_press
    from ragsnap.engine.engine import AnswerOptions
    from ragsnap.runtime.generation import GenerationConfig

    options = AnswerOptions(
        press=make_press(budget=budget), generation=GenerationConfig(max_new_tokens=max_new_tokens)
    )
    rows = []
    for item in items:
        done = engine.answer(item.question, item.documents, options)
        rows.append(
            {
                "id": item.id,
                "answer": done.answer,
                "correct": contains_any(done.answer, item.answers),
                "grounded": done.grounded,
                "score": done.grounded_score,
                "total_s": done.stats.total_s,
                "check_s": check_seconds(done, item.question, item.documents),
            }
        )
    return rows


def summarize(answerable: list[dict], unanswerable: list[dict]) -> dict[str, Any]:
    """The issue's metrics over both sets of rows."""
    right = [r for r in answerable if r["correct"]]
    kept_right = [r for r in right if r["grounded"] is not False]
    share = lambda rows, test: round(sum(map(test, rows)) / len(rows), 4) if rows else None  # noqa: E731
    ratios = [r["check_s"] / r["total_s"] for r in answerable + unanswerable if r["total_s"]]
    return {
        "n_answerable": len(answerable),
        "n_unanswerable": len(unanswerable),
        "answerable_accuracy": share(answerable, lambda r: r["correct"]),
        "right_answers_grounded": share(right, lambda r: r["grounded"] is True),
        "wrong_answers_not_grounded": share(
            [r for r in answerable if not r["correct"]], lambda r: r["grounded"] is False
        ),
        "unanswerable_not_grounded": share(unanswerable, lambda r: r["grounded"] is not True),
        "accuracy_with_abstain": round(len(kept_right) / len(answerable), 4)
        if answerable
        else None,
        "check_share_of_answer_time_median": round(statistics.median(ratios), 5)
        if ratios
        else None,
        "check_share_of_answer_time_max": round(max(ratios), 5) if ratios else None,
    }


def main(argv: Sequence[str] | None = None) -> int:
    from ragsnap.engine.engine import RagSnapEngine
    from ragsnap.eval.datasets import load_items

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", choices=("hotpotqa", "bioasq"), required=True)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("-n", type=int, default=50, help="items per set")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--context-tokens", type=int, default=2000, help="BioASQ padding")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--rows", type=Path, help="write every row (JSON) here")
    args = parser.parse_args(argv)
    engine = RagSnapEngine.load("embedded", device="cpu", dtype="float32")

    def count(text: str) -> int:
        return len(engine.tokenizer(text, add_special_tokens=False)["input_ids"])

    loaded = load_items(
        args.format,
        args.data,
        context_tokens=args.context_tokens,
        count_tokens=count,
        types=("factoid",) if args.format == "bioasq" else None,
    )
    items = [i for i in loaded.items if i.answers and i.gold_doc_ids][: args.n]
    pool = [d for i in loaded.items for d in i.documents]
    answerable = run_items(engine, items, args.budget, args.max_new_tokens)
    missing = [without_gold(i, pool, count) for i in items]
    unanswerable = run_items(engine, missing, args.budget, args.max_new_tokens)
    if args.rows:
        args.rows.write_text(json.dumps({"answerable": answerable, "unanswerable": unanswerable}))
    summary = {"format": args.format, "budget": args.budget, **summarize(answerable, unanswerable)}
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
