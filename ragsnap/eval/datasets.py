"""Loading evaluation items: generic JSONL, HotpotQA (MIRAGE layout), and the dispatcher."""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ragsnap.errors import InputError
from ragsnap.eval.items import ITEM_TYPES, EvalItem, LoadedItems, Malformed
from ragsnap.prompt.documents import Document

FORMATS = ("bioasq", "jsonl", "hotpotqa", "pubmedqa", "niah", "structured", "kvretrieval")
DATA_FORMATS = ("bioasq", "jsonl", "hotpotqa", "pubmedqa", "kvretrieval")  # read from --data


def _strings(value: Any, what: str) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, (str, int, float)) for v in value):
        raise ValueError(f"'{what}' must be a string or a list of strings")
    return [str(v) for v in value]


def jsonl_item(record: Any) -> EvalItem:
    """One generic record: ``{"id", "question", "documents": [{"id", "title", "text"}],
    "answers", "gold_doc_ids"?, "type"?, "answer_prefix"?}``. Raises ValueError if unusable.

    For ``"type": "list"``, ``answers`` holds one entry per expected entity (a string or a
    list of synonyms).
    """
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    item_id, question = record.get("id"), record.get("question")
    if not isinstance(item_id, (str, int)) or not isinstance(question, str) or not question.strip():
        raise ValueError("needs an 'id' and a non-empty 'question'")
    kind = record.get("type", "short")
    if kind not in ITEM_TYPES:
        raise ValueError(f"unknown type {kind!r} (choose from: {', '.join(ITEM_TYPES)})")
    raw_docs = record.get("documents")
    if not isinstance(raw_docs, list) or not raw_docs:
        raise ValueError("needs a non-empty 'documents' list")
    documents = []
    for i, doc in enumerate(raw_docs):
        if (
            not isinstance(doc, dict)
            or not isinstance(doc.get("text"), str)
            or not doc["text"].strip()
        ):
            raise ValueError(f"document {i} needs a non-empty 'text'")
        documents.append(
            Document(
                id=str(doc.get("id", i + 1)),
                title=str(doc.get("title", "")),
                text=doc["text"].strip(),
            )
        )
    if len({d.id for d in documents}) != len(documents):
        raise ValueError("duplicate document ids")
    raw_answers = record.get("answers")
    groups: list[list[str]] = []
    if kind == "list":
        if not isinstance(raw_answers, list) or not raw_answers:
            raise ValueError("a list item needs 'answers' (one entry per entity)")
        groups = [_strings(a, "answers") for a in raw_answers]
        answers: list[str] = []
    else:
        answers = _strings(raw_answers, "answers")
        if not answers:
            raise ValueError("needs at least one answer")
    return EvalItem(
        id=str(item_id),
        question=question.strip(),
        documents=documents,
        type=kind,
        answers=answers,
        answer_groups=groups,
        gold_doc_ids=_strings(record.get("gold_doc_ids", []), "gold_doc_ids"),
        answer_prefix=str(record.get("answer_prefix", "")),
    )


def load_jsonl(path: Path) -> LoadedItems:
    items: list[EvalItem] = []
    malformed: list[Malformed] = []
    for lineno, line in enumerate(_read(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            items.append(jsonl_item(json.loads(line)))
        except json.JSONDecodeError as exc:
            malformed.append(Malformed(f"{path.name}:{lineno}", f"not valid JSON ({exc.msg})"))
        except ValueError as exc:
            malformed.append(Malformed(f"{path.name}:{lineno}", str(exc)))
    return LoadedItems(items=items, malformed=malformed)


def hotpotqa_item(record: Any, seed: int) -> EvalItem:
    """A MIRAGE HotpotQA record: gold paragraphs ``title_a/para_a``, ``title_b/para_b``,
    distractors ``[[title, [sentences], score], ...]``; documents shuffled with the seed."""
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    item_id, question, answer = record.get("_id"), record.get("question"), record.get("answer")
    if not isinstance(item_id, str) or not isinstance(question, str) or not question.strip():
        raise ValueError("needs '_id' and 'question'")
    if not isinstance(answer, str) or not answer.strip():
        raise ValueError("needs an 'answer'")
    documents: list[Document] = []
    gold: list[str] = []
    for key in ("a", "b"):
        title, sentences = record.get(f"title_{key}"), record.get(f"para_{key}")
        if not isinstance(title, str) or not isinstance(sentences, list):
            raise ValueError(f"needs 'title_{key}' and 'para_{key}'")
        documents.append(Document(id=title, title=title, text="".join(map(str, sentences)).strip()))
        gold.append(title)
    for entry in record.get("distractors") or []:
        if isinstance(entry, list) and len(entry) >= 2 and isinstance(entry[1], list):
            title = str(entry[0])
            if title not in {d.id for d in documents}:
                documents.append(
                    Document(id=title, title=title, text="".join(map(str, entry[1])).strip())
                )
    documents = [d for d in documents if d.text]
    rng = random.Random(
        int.from_bytes(hashlib.sha256(f"{seed}:{item_id}".encode()).digest()[:8], "big")
    )
    rng.shuffle(documents)
    return EvalItem(
        id=item_id,
        question=question.strip(),
        documents=documents,
        type="short",
        answers=[answer.strip()],
        gold_doc_ids=gold,
    )


def load_hotpotqa(path: Path, seed: int = 0) -> LoadedItems:
    try:
        data = json.loads(_read(path))
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}: not valid JSON ({exc.msg})", field="data") from exc
    if not isinstance(data, list):
        raise InputError(f"{path}: expected a JSON list of HotpotQA records", field="data")
    items: list[EvalItem] = []
    malformed: list[Malformed] = []
    for i, record in enumerate(data):
        try:
            items.append(hotpotqa_item(record, seed))
        except ValueError as exc:
            malformed.append(Malformed(f"{path.name}#{i}", str(exc)))
    return LoadedItems(items=items, malformed=malformed)


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read {path}: {exc}", field="data") from exc


def _files(path: Path, pattern: str) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.glob(pattern) if p.is_file())
        if not files:
            raise InputError(f"no {pattern} files in {path}", field="data")
        return files
    if not path.is_file():
        raise InputError(f"data not found: {path}", field="data")
    return [path]


def load_items(
    fmt: str,
    path: Path | None,
    *,
    seed: int = 0,
    context_tokens: int | None = None,
    count_tokens: Callable[[str], int] | None = None,
    types: tuple[str, ...] | None = None,
) -> LoadedItems:
    """Load a data set of format ``bioasq``, ``jsonl``, ``hotpotqa``, ``pubmedqa`` or
    ``kvretrieval``
    (``niah`` and ``structured`` items are built by :func:`ragsnap.eval.niah.build_needles`
    and :func:`ragsnap.eval.structured.build_structured`)."""
    if path is None:
        raise InputError(f"--data is required for --format {fmt}", field="data")
    if fmt == "bioasq":
        from ragsnap.eval.bioasq import load_bioasq

        loaded = load_bioasq(
            _files(path, "*.json"),
            seed=seed,
            context_tokens=context_tokens,
            count_tokens=count_tokens,
            types=types,
        )
    elif fmt == "jsonl":
        loaded = (
            load_jsonl(_files(path, "*.jsonl")[0])
            if path.is_file()
            else _merge([load_jsonl(p) for p in _files(path, "*.jsonl")])
        )
    elif fmt == "hotpotqa":
        loaded = _merge([load_hotpotqa(p, seed) for p in _files(path, "*.json")])
    elif fmt == "pubmedqa":
        from ragsnap.eval.pubmedqa import load_pubmedqa

        loaded = _merge([load_pubmedqa(p) for p in _files(path, "*.json")])
    elif fmt == "kvretrieval":
        from ragsnap.eval.structured import load_kv_retrieval

        files = [path] if path.is_file() else _files(path, "*.jsonl*")
        loaded = _merge(
            [
                load_kv_retrieval(p, context_tokens=context_tokens, count_tokens=count_tokens)
                for p in files
            ]
        )
    else:
        raise InputError(
            f"unknown format {fmt!r} (choose from: {', '.join(FORMATS)})", field="format"
        )
    if types is not None and fmt != "bioasq":
        loaded.items = [i for i in loaded.items if i.type in types]
    return loaded


def _merge(parts: list[LoadedItems]) -> LoadedItems:
    return LoadedItems(
        items=[i for p in parts for i in p.items], malformed=[m for p in parts for m in p.malformed]
    )


def _head(path: Path, size: int = 4096) -> str:
    import gzip

    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8", errors="replace") as handle:
            return str(handle.read(size)).lstrip()
    except OSError:
        return ""


def guess_format(path: Path) -> str:
    """The format of a data file, from its name and first characters (a folder: from its
    first data file): ``kvretrieval`` for JSON lines of ``ordered_kv_records``, ``jsonl``
    for other .jsonl files, ``hotpotqa`` for a JSON list, ``pubmedqa`` for an object of
    records with ``QUESTION``, else ``bioasq``."""
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and ".json" in p.name)
        return guess_format(files[0]) if files else "bioasq"
    if path.name.endswith((".jsonl", ".jsonl.gz")):
        first_line = _head(path).split("\n", 1)[0]
        return "kvretrieval" if '"ordered_kv_records"' in first_line else "jsonl"
    if path.suffix == ".json":
        head = _head(path)
        if head.startswith("["):
            return "hotpotqa"
        if head.startswith("{") and '"QUESTION"' in head and '"questions"' not in head[:64]:
            return "pubmedqa"
    return "bioasq"
