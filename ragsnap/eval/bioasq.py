"""BioASQ Task-B golden JSON -> evaluation items.

Each question's snippets are grouped by PubMed id into one passage per document (titled
by the id). With a target prompt length, passages of other questions pad the prompt;
the documents are then shuffled with the seed. Gold documents are the union of the
question's ``documents`` and its snippets' documents.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ragsnap.errors import InputError
from ragsnap.eval.items import EvalItem, LoadedItems, Malformed
from ragsnap.prompt.documents import Document

BIOASQ_TYPES = ("yesno", "factoid", "list", "summary")


def pubmed_id(url: str) -> str:
    """``http://www.ncbi.nlm.nih.gov/pubmed/26168008`` -> ``26168008``."""
    return str(url).rstrip("/").rsplit("/", 1)[-1]


def _passages(question: dict[str, Any]) -> dict[str, str]:
    """PubMed id -> the question's snippets of that document, deduplicated, in order."""
    grouped: dict[str, list[str]] = {}
    for snippet in question.get("snippets") or []:
        if not isinstance(snippet, dict):
            continue
        text, doc = snippet.get("text"), snippet.get("document")
        if not isinstance(text, str) or not text.strip() or not doc:
            continue
        texts = grouped.setdefault(pubmed_id(doc), [])
        if text.strip() not in texts:
            texts.append(text.strip())
    return {pmid: " ".join(texts) for pmid, texts in grouped.items()}


def snippet_spans(
    passage_texts: dict[str, str], question: dict[str, Any]
) -> dict[str, list[list[int]]]:
    """Per PubMed id, the ``[start, end)`` character spans of the question's snippets in
    that document's passage (the text :func:`_passages` built)."""
    spans: dict[str, list[list[int]]] = {}
    for snippet in question.get("snippets") or []:
        if not isinstance(snippet, dict) or not isinstance(snippet.get("text"), str):
            continue
        pmid = pubmed_id(snippet.get("document") or "")
        text, passage = snippet["text"].strip(), passage_texts.get(pmid)
        at = passage.find(text) if passage and text else -1
        if at >= 0 and [at, at + len(text)] not in spans.get(pmid, []):
            spans.setdefault(pmid, []).append([at, at + len(text)])
    return spans


def _flat(values: Any) -> list[str]:
    if isinstance(values, str):
        return [values]
    if isinstance(values, list):
        return [s for v in values for s in _flat(v)]
    return []


def _answers(question: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    kind, exact = question["type"], question.get("exact_answer")
    if kind == "yesno":
        label = exact if isinstance(exact, str) else (_flat(exact) or [""])[0]
        label = label.strip().lower()
        if label not in ("yes", "no"):
            raise ValueError(f"yes/no exact_answer is {exact!r}")
        return [label], []
    if kind == "factoid":
        synonyms = _flat(exact)
        if not synonyms:
            raise ValueError("factoid question without exact_answer")
        return synonyms, []
    if kind == "list":
        groups = [_flat(g) for g in exact] if isinstance(exact, list) else []
        groups = [g for g in groups if g]
        if not groups:
            raise ValueError("list question without exact_answer")
        return [], groups
    ideal = _flat(question.get("ideal_answer"))
    if not ideal:
        raise ValueError("summary question without ideal_answer")
    return ideal, []


def _item_seed(seed: int, item_id: str) -> int:
    digest = hashlib.sha256(f"{seed}:{item_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def load_bioasq(
    paths: list[Path],
    *,
    seed: int = 0,
    context_tokens: int | None = None,
    count_tokens: Callable[[str], int] | None = None,
    types: tuple[str, ...] | None = None,
) -> LoadedItems:
    """Read Task-B golden files (a file, or a folder of ``*.json``) into items.

    Parameters
    ----------
    context_tokens : pad each prompt with other questions' passages up to about this many
        document tokens (needs ``count_tokens``, which counts a formatted document's tokens).
    types : keep only these question types (all when None).
    """
    questions: list[tuple[str, dict[str, Any]]] = []
    malformed: list[Malformed] = []
    for path in paths:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InputError(f"cannot read BioASQ file {path}: {exc}", field="data") from exc
        if not isinstance(data, dict) or not isinstance(data.get("questions"), list):
            raise InputError(f'{path}: expected {{"questions": [...]}}', field="data")
        for i, q in enumerate(data["questions"]):
            questions.append((f"{path.name}#{i}", q))
    pool: list[tuple[str, str, str]] = []  # (owner question id, pmid, passage) for padding
    parsed: list[tuple[str, dict[str, Any], dict[str, str]]] = []
    for where, q in questions:
        try:
            if not isinstance(q, dict):
                raise ValueError("not a JSON object")
            qid, body, kind = q.get("id"), q.get("body"), q.get("type")
            if not isinstance(qid, str) or not qid or not isinstance(body, str) or not body.strip():
                raise ValueError("missing id or body")
            if kind not in BIOASQ_TYPES:
                raise ValueError(f"unknown type {kind!r}")
            passages = _passages(q)
            if not passages:
                raise ValueError("no usable snippets")
        except ValueError as exc:
            malformed.append(Malformed(where, str(exc)))
            continue
        pool.extend((qid, pmid, text) for pmid, text in passages.items())
        parsed.append((where, q, passages))

    items: list[EvalItem] = []
    for where, q, passages in parsed:
        if types is not None and q["type"] not in types:
            continue
        try:
            answers, groups = _answers(q)
        except ValueError as exc:
            malformed.append(Malformed(f"{where} ({q['id']})", str(exc)))
            continue
        gold = list(
            dict.fromkeys([pubmed_id(d) for d in q.get("documents") or []] + list(passages))
        )
        documents = [Document(id=pmid, title=pmid, text=text) for pmid, text in passages.items()]
        rng = random.Random(_item_seed(seed, q["id"]))
        if context_tokens and count_tokens is not None:
            documents += _padding(
                q["id"], set(gold), documents, pool, context_tokens, count_tokens, rng
            )
        rng.shuffle(documents)
        items.append(
            EvalItem(
                id=q["id"],
                question=q["body"].strip(),
                documents=documents,
                type=q["type"],
                answers=answers,
                answer_groups=groups,
                gold_doc_ids=gold,
                metadata={"source": where, "evidence_spans": snippet_spans(passages, q)},
            )
        )
    return LoadedItems(items=items, malformed=malformed)


def _padding(
    qid: str,
    gold: set[str],
    documents: list[Document],
    pool: list[tuple[str, str, str]],
    context_tokens: int,
    count_tokens: Callable[[str], int],
    rng: random.Random,
) -> list[Document]:
    """Passages of other questions, drawn at random, while the documents fit ``context_tokens``."""
    used = sum(count_tokens(f"[{len(documents)}] {d.title}\n{d.text}\n\n") for d in documents)
    seen = {d.id for d in documents} | gold
    order = list(range(len(pool)))
    rng.shuffle(order)
    extra: list[Document] = []
    for index in order:
        owner, pmid, text = pool[index]
        if owner == qid or pmid in seen:
            continue
        cost = count_tokens(f"[{len(documents) + len(extra) + 1}] {pmid}\n{text}\n\n")
        if used + cost > context_tokens:
            if context_tokens - used < 32:
                break
            continue
        seen.add(pmid)
        extra.append(Document(id=pmid, title=pmid, text=text))
        used += cost
    return extra
