"""Answers from the model's own knowledge (issue 53): common-knowledge questions
(:mod:`ragsnap.eval.world_questions`) each asked over documents that do not hold the
answer, so no answer may be grounded.

``python -m ragsnap.eval.world_knowledge --haystack DIR --hotpotqa PATH --bioasq PATH``
prints one JSON object: how many answers are not grounded (the target), how many of
them the model answered right from memory and how many of those are not grounded, and
the check's share of an answer's time. The documents rotate over the sources given
(essays cut into passages, other questions' HotpotQA passages, BioASQ snippets), read at
run time; a passage holding one of the question's answers is never used. Rows
(``--rows``) carry the verdict, the lists the response reports and every feature a rule
reads (:func:`ragsnap.eval.grounding_eval.check_features`).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ragsnap.eval.metrics import contains_any
from ragsnap.eval.world_questions import WORLD_QUESTIONS
from ragsnap.prompt.documents import Document


def essay_passages(folder: Path, size: int = 1500) -> list[Document]:
    """The ``.txt`` essays of ``folder`` cut at paragraph ends into passages of about
    ``size`` characters (titled by the essay's file name)."""
    out: list[Document] = []
    for path in sorted(folder.glob("*.txt")):
        if path.name.startswith("LICENSE"):
            continue
        chunk = ""
        for para in path.read_text(encoding="utf-8", errors="replace").split("\n\n"):
            chunk = f"{chunk}\n\n{para}".strip()
            if len(chunk) >= size:
                out.append(Document(id=f"{path.stem}:{len(out)}", title=path.stem, text=chunk))
                chunk = ""
    return out


def pick_documents(
    pool: Sequence[Document],
    answers: Sequence[str],
    tokens: int,
    count_tokens: Callable[[str], int],
    rng: random.Random,
) -> list[Document]:
    """Documents of ``pool`` in a random order, none holding one of ``answers``, until
    they make ``tokens`` tokens."""
    candidates = [d for d in pool if not contains_any(f"{d.title}\n{d.text}", list(answers))]
    rng.shuffle(candidates)
    out: list[Document] = []
    used = 0
    for doc in candidates:
        if used >= tokens:
            break
        out.append(doc)
        used += count_tokens(doc.text)
    return out


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Not grounded overall and among the answers right from memory; the check's share."""
    share = lambda part, whole: round(len(part) / len(whole), 4) if whole else None  # noqa: E731
    right = [r for r in rows if r["correct"]]
    ratios = [r["check_s"] / r["total_s"] for r in rows if r["total_s"]]
    return {
        "n": len(rows),
        "not_grounded": share([r for r in rows if r["grounded"] is not True], rows),
        "right_from_memory": share(right, rows),
        "right_from_memory_not_grounded": share([r for r in right if r["grounded"] is not True], right),
        "answer_not_in_documents_reported": share([r for r in rows if r["answer_not_in_documents"]], rows),
        "check_share_of_answer_time_mean": round(statistics.mean(ratios), 5) if ratios else None,
        "by_source": {
            s: share([r for r in rows if r["source"] == s and r["grounded"] is not True],
                     [r for r in rows if r["source"] == s])
            for s in sorted({r["source"] for r in rows})
        },
    }  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    from ragsnap.compression import make_press
    from ragsnap.engine.engine import AnswerOptions, RagSnapEngine
    from ragsnap.eval.datasets import load_items
    from ragsnap.eval.grounding_eval import check_features
    from ragsnap.runtime.generation import GenerationConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--haystack", type=Path, help="a folder of .txt essays")
    parser.add_argument("--hotpotqa", type=Path, help="HotpotQA (MIRAGE layout)")
    parser.add_argument("--bioasq", type=Path, help="a BioASQ task folder")
    parser.add_argument("-n", type=int, default=len(WORLD_QUESTIONS))
    parser.add_argument("--tokens", type=int, default=1500, help="document tokens per prompt")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--rows", type=Path, help="write every row (JSON) here")
    args = parser.parse_args(argv)
    engine = RagSnapEngine.load(
        "embedded", device="cpu", dtype="float32", cache_url="none", threads=args.threads
    )

    def count(text: str) -> int:
        return len(engine.tokenizer(text, add_special_tokens=False)["input_ids"])

    pools: dict[str, list[Document]] = {}
    if args.haystack:
        pools["essays"] = essay_passages(args.haystack)
    for name, path in (("hotpotqa", args.hotpotqa), ("bioasq", args.bioasq)):
        if path:
            loaded = load_items(name, path, context_tokens=args.tokens, count_tokens=count)
            unique = {d.id: d for i in loaded.items for d in i.documents}  # padding repeats
            pools[name] = list(unique.values())
    if not pools:
        parser.error("give at least one of --haystack, --hotpotqa, --bioasq")
    options = AnswerOptions(
        press=make_press(budget=args.budget),
        generation=GenerationConfig(max_new_tokens=args.max_new_tokens),
    )
    names = sorted(pools)
    rows = []
    for i, (question, answers) in enumerate(WORLD_QUESTIONS[: args.n]):
        source = names[i % len(names)]
        rng = random.Random(f"world:{i}")
        documents = pick_documents(pools[source], answers, args.tokens, count, rng)
        done = engine.answer(question, documents, options)
        rows.append(
            {
                "id": i,
                "source": source,
                "question": question,
                "answer": done.answer,
                "correct": contains_any(done.answer, list(answers)),
                "grounded": done.grounded,
                "score": done.grounded_score,
                "not_in_documents": done.not_in_documents,
                "answer_not_in_documents": done.answer_not_in_documents,
                "unsupported_sentences": done.unsupported_sentences,
                "total_s": done.stats.total_s,
                **check_features(engine, done, question, documents),
            }
        )
    if args.rows:
        args.rows.write_text(json.dumps(rows))
    print(
        json.dumps(
            {"likelihood_rule": engine.citing.lift_rule is not None, **summarize(rows)}, indent=2
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
