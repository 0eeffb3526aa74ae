"""PubMedQA (expert-labelled, MIRAGE layout) -> yes/no/maybe evaluation items.

The file maps a PubMed id to ``{"QUESTION", "CONTEXTS": [...], "LABELS": [...],
"final_decision", "LONG_ANSWER"}``. Each context (an abstract section, named by its
label) becomes one document; all of them are gold evidence. The item is a ``yesno`` item
whose gold is ``final_decision`` (yes, no or maybe; the question says so), scored by accuracy and macro-F1 over
the three labels; ``LONG_ANSWER`` is kept in the metadata.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ragsnap.errors import InputError
from ragsnap.eval.items import EvalItem, LoadedItems, Malformed
from ragsnap.prompt.documents import Document

DECISIONS = ("yes", "no", "maybe")
# the model is told the three answers (as MIRAGE's options do): "maybe" is otherwise rare
ANSWER_HINT = "Answer yes, no or maybe, then explain briefly."


def looks_like_pubmedqa(data: Any) -> bool:
    """A JSON object whose first value has ``QUESTION`` and ``CONTEXTS``."""
    if not isinstance(data, dict) or not data:
        return False
    first = next(iter(data.values()))
    return isinstance(first, dict) and "QUESTION" in first and "CONTEXTS" in first


def pubmedqa_item(pmid: str, record: Any) -> EvalItem:
    """One PubMedQA record; raises ValueError when it is unusable."""
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    question, contexts = record.get("QUESTION"), record.get("CONTEXTS")
    if not isinstance(question, str) or not question.strip():
        raise ValueError("needs a non-empty 'QUESTION'")
    if not isinstance(contexts, list) or not any(
        isinstance(c, str) and c.strip() for c in contexts
    ):
        raise ValueError("needs a non-empty 'CONTEXTS' list")
    decision = str(record.get("final_decision", "")).strip().lower()
    if decision not in DECISIONS:
        raise ValueError(f"final_decision is {record.get('final_decision')!r}, not yes/no/maybe")
    raw_labels = record.get("LABELS")
    labels: list[Any] = raw_labels if isinstance(raw_labels, list) else []
    documents = []
    for i, text in enumerate(contexts):
        if isinstance(text, str) and text.strip():
            section = str(labels[i]).title() if i < len(labels) else ""
            documents.append(Document(id=f"{pmid}-{i + 1}", title=section, text=text.strip()))
    return EvalItem(
        id=str(pmid),
        question=f"{question.strip()} {ANSWER_HINT}",
        documents=documents,
        type="yesno",
        answers=[decision],
        gold_doc_ids=[d.id for d in documents],
        metadata={"long_answer": str(record.get("LONG_ANSWER", ""))},
    )


def load_pubmedqa(path: Path) -> LoadedItems:
    """Every record of one PubMedQA JSON file (unusable records reported, not raised)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read {path}: {exc}", field="data") from exc
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}: not valid JSON ({exc.msg})", field="data") from exc
    if not isinstance(data, dict):
        raise InputError(
            f"{path}: expected a JSON object of PubMed id -> PubMedQA record", field="data"
        )
    items: list[EvalItem] = []
    malformed: list[Malformed] = []
    for pmid, record in data.items():
        try:
            items.append(pubmedqa_item(pmid, record))
        except ValueError as exc:
            malformed.append(Malformed(f"{path.name}#{pmid}", str(exc)))
    return LoadedItems(items=items, malformed=malformed)
