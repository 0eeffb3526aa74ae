"""Grounded against correct (issue 43): the claim-level verdict on answerable items and on
the same items with their gold documents removed (padded back with other items'
documents to the same prompt length), so the documents do not answer them.

``python -m ragsnap.eval.grounding_eval --format hotpotqa --data PATH -n 50`` prints one
JSON object: per set, answerable accuracy, the share of right answers that are grounded,
the share of unanswerable answers that are not grounded (what ``abstain`` would replace),
the accuracy ``abstain`` would keep, and the check's time against the answer's. Each row
also holds the lexical verdict alone, every feature a rule may read, measured without the
gate (:func:`answer_features`: the likelihood lifts of :mod:`ragsnap.citations.lift`, the
question's coverage variants of :mod:`ragsnap.citations.relevance`), and the raw material
they come from (:func:`raw_material`; ``ragsnap.eval.grounding_features`` measures them
again), so a rule can be calibrated on the rows of held-out items (``--skip 50``: items
51-100; ``ragsnap.eval.grounding_calibrate``).
``--instruction abstain`` adds the sentence the shipped instruction dropped (say so when
the documents do not answer) for the abstention-prompt experiment.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ragsnap.citations.asked import (
    all_quotes,
    answer_kind,
    asked_kind,
    options_about,
    options_quoted,
    supplies,
)
from ragsnap.citations.lift import key_sentence, sentence_quotes
from ragsnap.citations.model import Citation
from ragsnap.citations.named import missing_terms
from ragsnap.citations.relevance import HARD_KINDS, cited_documents, coverage, missing_kinds
from ragsnap.citations.sentences import Sentence
from ragsnap.citations.support import check_sentence
from ragsnap.citations.verdict import Verdict, grounding
from ragsnap.engine.events import DoneEvent
from ragsnap.eval.items import EvalItem
from ragsnap.eval.metrics import contains_any
from ragsnap.prompt import assembly
from ragsnap.prompt.documents import Document

# the model says the documents do not hold the answer (the abstention-prompt experiment)
_SAYS_NO_ANSWER = re.compile(
    r"\b(?:documents?|passages?|texts?|context|information)\b[^.]{0,40}?"
    r"\b(?:do(?:es)?\s+not|don['’]t|doesn['’]t|not)\b"
    r"|\b(?:not\s+(?:mentioned|provided|specified|stated|given)|no\s+(?:information|mention))\b",
    re.IGNORECASE,
)
# the abstention-prompt experiment (issue 43): the instruction as it was before session 24,
# with its sentence about answers the documents lack (the shipped one no longer has it)
ABSTAIN_INSTRUCTION = (
    assembly.SYSTEM_INSTRUCTION
    + " If the documents do not contain the answer, say that they do not."
)


def says_no_answer(answer: str) -> bool:
    """Whether ``answer`` says the documents do not answer (a model abstaining itself)."""
    return bool(_SAYS_NO_ANSWER.search(answer))


@contextmanager
def system_instruction(text: str) -> Iterator[None]:
    """Prompts assembled in this block use ``text`` as the system instruction (the
    experiment only: the shipped prompt is ``assembly.SYSTEM_INSTRUCTION``)."""
    defaults = assembly.assemble_prompt.__kwdefaults__
    assert defaults is not None, "assemble_prompt takes its system instruction by keyword"
    saved = defaults["system"]
    defaults["system"] = text
    try:
        yield
    finally:
        defaults["system"] = saved


def item_pairs(engine: Any, args: argparse.Namespace) -> tuple[list[EvalItem], list[EvalItem]]:
    """The answerable items of ``args`` (``--format``, ``--data``, ``--context-tokens``:
    items with answers and gold documents, ``--skip`` then ``-n``) and each one again with
    its gold documents replaced by other items' (:func:`without_gold`)."""
    from ragsnap.eval.datasets import load_items

    def count(text: str) -> int:
        return len(engine.tokenizer(text, add_special_tokens=False)["input_ids"])

    loaded = load_items(
        args.format,
        args.data,
        context_tokens=args.context_tokens,
        count_tokens=count,
        types=("factoid",) if args.format == "bioasq" else None,
    )
    usable = [i for i in loaded.items if i.answers and i.gold_doc_ids]
    items = usable[args.skip : args.skip + args.n]
    pool = [d for i in loaded.items for d in i.documents]
    return items, [without_gold(i, pool, count) for i in items]


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


def check_features(
    engine: Any, done: DoneEvent, question: str, documents: Sequence[Document]
) -> dict[str, Any]:
    """The claim-level work on ``done`` again, timed: each cited sentence against its
    citation's quotes and document, the lexical verdict, then the key sentence's
    evidence (what the engine adds per answer: its pass only when the rule needs it),
    with what it found (:func:`answer_features`, every feature measured)."""
    answer = done.model_answer if done.model_answer is not None else done.answer
    by_id = {d.id: d for d in documents}  # a citation's index is the prompt's order
    started = time.perf_counter()
    for citation in done.citations:
        doc = by_id[citation.doc_id]
        quotes = [q.text for q in citation.quotes] + [doc.title]
        for start, end in citation.spans:
            check_sentence(Sentence(answer[start:end], start, end), quotes, [doc.text], question)
    grounding(answer, done.citations)
    lexical_s = time.perf_counter() - started
    cited = prompt_documents(done.citations, documents)
    engine.citing.key_evidence(question, answer, done.citations, cited)
    check_s = time.perf_counter() - started
    return {
        "check_s": check_s,
        "lexical_check_s": lexical_s,
        **answer_features(engine, question, answer, done.citations, cited),
    }


def prompt_documents(
    citations: Sequence[Citation], documents: Sequence[Document]
) -> list[Document]:
    """Every document of ``documents``, the cited ones in the prompt's order (index
    ``i`` of a citation is entry ``i - 1``); the others, in the given order, fill the
    entries no citation names and follow."""
    by_id = {d.id: d for d in documents}
    size = max((c.index for c in citations), default=0)
    out: list[Document | None] = [None] * size
    for c in citations:
        if c.doc_id in by_id:
            out[c.index - 1] = by_id[c.doc_id]
    rest = iter([d for d in documents if all(d is not o for o in out)])
    filled = [d if d is not None else next(rest, Document(id="", text="")) for d in out]
    return filled + list(rest)


def answer_features(
    engine: Any,
    question: str,
    answer: str,
    citations: Sequence[Citation],
    cited: Sequence[Document],
) -> dict[str, Any]:
    """Every feature a grounded rule may read, measured without the gate: the lexical
    verdict, the key sentence's support, lift and missing kinds, the question's lift
    given the key sentence's quotes and its coverage by several texts (the answer, the
    key sentence's quotes, its cited documents, all cited documents; ``ent_``: its
    numbers and names only), the question's names no document holds and ``named`` (1.0:
    none), and per term kind the answer's words no document holds (``answer_missing``,
    :func:`ragsnap.citations.named.missing_terms`) and whether the key sentence's names
    are linked to the question's subject (``linked``, :func:`ragsnap.citations.relevance.unlinked`;
    None: not checkable)."""
    lexical: Verdict = grounding(answer, citations)
    found = engine.citing.key_evidence(question, answer, list(citations), cited, gate=False)
    key = found.key
    unsupported = {tuple(span) for span in lexical.unsupported}
    quotes = sentence_quotes(key, citations) if key is not None else []
    mine = [cited[i - 1] for i in cited_documents(key, citations)] if key is not None else []
    docs = [t for d in mine for t in (d.title, d.text)]
    indices = sorted({c.index for c in citations if 0 < c.index <= len(cited)})
    every = [t for i in indices for t in (cited[i - 1].title, cited[i - 1].text)]
    hard = HARD_KINDS
    return {
        "lexical_grounded": lexical.grounded,
        "lexical_score": lexical.score,
        "key_supported": key is not None and (key.start, key.end) not in unsupported,
        "has_key": key is not None,
        "lift": found.lift,
        "question_lift": found.question_lift,
        "plain": found.plain,
        "key_missing": sorted(missing_kinds(key, citations)) if key is not None else [],
        "coverage": found.coverage,
        "not_in_documents": list(found.not_in_documents),
        "named": 0.0 if found.not_in_documents else 1.0,
        "linked": None if found.unlinked is None else not found.unlinked,
        "answer_missing": missing_terms(answer, cited, question),
        "cov_answer": coverage(question, [answer]),
        "cov_quotes": coverage(question, quotes),
        "cov_docs": coverage(question, docs),
        "cov_all": coverage(question, every),
        "ent_answer": coverage(question, [answer], hard),
        "ent_quotes": coverage(question, quotes, hard),
        "ent_docs": coverage(question, docs, hard),
        "ent_all": coverage(question, every, hard),
        **kind_features(question, answer, citations),
    }


def kind_features(question: str, answer: str, citations: Sequence[Citation]) -> dict[str, Any]:
    """Whether the answer supplies the kind of thing asked (:mod:`ragsnap.citations.asked`;
    lexical, no model), with what it is read from: the asked kind and options, whether
    every option is quoted at all (``options_quoted``) and as a fact about it
    (``options_about``, what the kind reads), the kind with no invented number or name
    beside the backed answer (``kind_strict``), and whether any quote of the answer (not only the key
    sentence's) backs something of the asked kind (``kind_any``)."""
    asked = asked_kind(question)
    quotes = all_quotes(citations)
    key = key_sentence(answer, question)
    text = key.text if key is not None else ""
    return {
        "kind": answer_kind(question, answer, citations),
        "kind_strict": answer_kind(question, answer, citations, strict=True),
        "asked": asked.kind,
        "asked_noun": asked.noun,
        "asked_options": list(asked.options),
        "options_quoted": options_quoted(asked.options, quotes) if asked.options else None,
        "options_about": options_about(asked.options, citations) if asked.options else None,
        "kind_any": supplies(asked.kind, text, quotes, question)
        if asked.kind not in ("pair", "yesno", "choice")
        else None,
    }


def raw_material(done: DoneEvent, question: str, documents: Sequence[Document]) -> dict[str, Any]:
    """What a rule's features are computed from again (``grounding_calibrate``): the
    question, the model's answer, its checked citations and the cited documents."""
    by_id = {d.id: d for d in documents}
    return {
        "question": question,
        "model_answer": done.model_answer if done.model_answer is not None else done.answer,
        "citations": [c.to_dict() for c in done.citations],
        # by the citation's index (the prompt's order, which may not be the given one)
        "documents": {
            str(c.index): {"title": by_id[c.doc_id].title, "text": by_id[c.doc_id].text}
            for c in done.citations
            if c.doc_id in by_id
        },
    }


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
                "says_no_answer": says_no_answer(done.answer),
                "grounded": done.grounded,
                "score": done.grounded_score,
                "unsupported_sentences": done.unsupported_sentences,
                "answer_not_in_documents": done.answer_not_in_documents,
                "total_s": done.stats.total_s,
                **check_features(engine, done, item.question, item.documents),
                **raw_material(done, item.question, item.documents),
            }
        )
    return rows


def summarize(
    answerable: list[dict], unanswerable: list[dict], verdict: str = "grounded"
) -> dict[str, Any]:
    """The issue's metrics over both sets of rows, by the rows' ``verdict`` field
    (``grounded``: the engine's; ``lexical_grounded``: the lexical rule alone)."""
    answerable = [{**r, "grounded": r[verdict]} for r in answerable]
    unanswerable = [{**r, "grounded": r[verdict]} for r in unanswerable]
    right = [r for r in answerable if r["correct"]]
    kept_right = [r for r in right if r["grounded"] is not False]
    share = lambda rows, test: round(sum(map(test, rows)) / len(rows), 4) if rows else None  # noqa: E731
    ratios = [r["check_s"] / r["total_s"] for r in answerable + unanswerable if r["total_s"]]
    return {
        "says_no_answer_answerable": share(answerable, lambda r: r["says_no_answer"]),
        "says_no_answer_unanswerable": share(unanswerable, lambda r: r["says_no_answer"]),
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

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", choices=("hotpotqa", "bioasq"), required=True)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("-n", type=int, default=50, help="items per set")
    parser.add_argument("--skip", type=int, default=0, help="leave out the first items")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--instruction", choices=("shipped", "abstain"), default="shipped")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--context-tokens", type=int, default=2000, help="BioASQ padding")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--rows", type=Path, help="write every row (JSON) here")
    args = parser.parse_args(argv)
    # no KV cache: every answer is computed, so its time is an answer's time
    engine = RagSnapEngine.load(
        "embedded", device="cpu", dtype="float32", cache_url="none", threads=args.threads
    )

    items, missing = item_pairs(engine, args)
    system = assembly.SYSTEM_INSTRUCTION if args.instruction == "shipped" else ABSTAIN_INSTRUCTION
    with system_instruction(system):
        answerable = run_items(engine, items, args.budget, args.max_new_tokens)
        unanswerable = run_items(engine, missing, args.budget, args.max_new_tokens)
    if args.rows:
        args.rows.write_text(json.dumps({"answerable": answerable, "unanswerable": unanswerable}))
    summary = {
        "format": args.format,
        "budget": args.budget,
        "items": f"{args.skip + 1}-{args.skip + len(items)}",
        "instruction": args.instruction,
        "likelihood_rule": engine.citing.lift_rule is not None,
        **summarize(answerable, unanswerable),
        "lexical_only": summarize(answerable, unanswerable, "lexical_grounded"),
    }
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
