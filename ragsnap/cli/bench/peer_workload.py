"""The RAG workload of ``ragsnap bench peer``: the same prompts, token for token, for both servers.

Each request is a question over ordered documents. ragsnap gets the documents and the
question (``/v1/answer``); the peer gets the token ids of the prompt ragsnap builds from
them (:func:`ragsnap.prompt.assembly.assemble_prompt`: chat template, numbered documents, question
last), so both prefill the same tokens. Three scenarios per concurrency level:

- ``cold``: document sets neither server has seen;
- ``repeated``: the same requests again (ragsnap: exact cache hits; the peer: its prefix cache);
- ``new_question``: a new question over each already-seen document set (ragsnap: the
  document-prefix tier; the peer: its prefix cache over the shared document tokens).

Every concurrency level gets document sets of its own, so its cold requests are cold.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ragsnap.eval.items import EvalItem
from ragsnap.prompt.documents import Document

SCENARIOS = ("cold", "repeated", "new_question")
NEW_QUESTION = "In one or two sentences, what do the documents say about {title}?"


@dataclass(frozen=True)
class PeerRequest:
    """One request of the workload, in both servers' terms."""

    id: str
    question: str
    documents: tuple[Document, ...]
    prompt_ids: tuple[int, ...]
    reference: tuple[str, ...] = ()  # the data set's answers (cold and repeated only)

    def answer_body(self, max_new_tokens: int, compression: dict[str, Any]) -> dict[str, Any]:
        """The ``/v1/answer`` body: documents and question, greedy, streamed."""
        body: dict[str, Any] = {
            "question": self.question,
            "documents": [{"id": d.id, "title": d.title, "text": d.text} for d in self.documents],
            "max_new_tokens": max_new_tokens,
            "temperature": 0.0,
            "stream": True,
            "document_order": "given",  # the peer's prompt, token for token
        }
        if compression:
            body["compression"] = compression
        return body

    def completion_body(self, max_new_tokens: int, stop_ids: Sequence[int]) -> dict[str, Any]:
        """The peer's ``/v1/completions`` body: the same prompt as token ids, greedy, streamed."""
        return {
            "model": "peer",
            "prompt": list(self.prompt_ids),
            "max_tokens": max_new_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "stop_token_ids": sorted(stop_ids),
            "skip_special_tokens": True,
        }


def padded_documents(
    item: EvalItem, pool: Sequence[EvalItem], context_tokens: int, count: Any
) -> list[Document]:
    """``item``'s documents, then other items' documents until about ``context_tokens``."""
    documents = list(item.documents)
    seen = {d.id for d in documents}
    total = sum(count(f"{d.title}\n{d.text}") for d in documents)
    for other in pool:
        for doc in other.documents:
            if total >= context_tokens:
                return documents
            if doc.id not in seen:
                documents.append(doc)
                seen.add(doc.id)
                total += count(f"{doc.title}\n{doc.text}")
    return documents


def topic(item: EvalItem, documents: Sequence[Document]) -> str:
    """What a new question asks about: the title of the item's first gold document (else
    the first document's), or its first words where the title is empty or a bare number."""
    by_id = {d.id: d for d in documents}
    gold = [by_id[g] for g in item.gold_doc_ids if g in by_id] or list(documents)
    doc = gold[0]
    title = doc.title.strip()
    if title and not title.replace("-", "").isdigit():
        return title
    return " ".join(doc.text.split()[:6])


def build_request(
    request_id: str,
    question: str,
    documents: Sequence[Document],
    tokenizer: Any,
    max_prompt_tokens: int,
    reference: Sequence[str] = (),
) -> PeerRequest:
    from ragsnap.prompt.assembly import assemble_prompt

    layout = assemble_prompt(tokenizer, question, documents, max_prompt_tokens=max_prompt_tokens)
    return PeerRequest(
        id=request_id,
        question=question,
        documents=tuple(layout.documents),
        prompt_ids=tuple(layout.input_ids),
        reference=tuple(reference),
    )


def build_workload(
    items: Sequence[EvalItem],
    tokenizer: Any,
    *,
    levels: Sequence[int],
    prompts: int,
    context_tokens: int,
    max_prompt_tokens: int,
) -> dict[int, dict[str, list[PeerRequest]]]:
    """``{concurrency: {scenario: requests}}``, ``prompts`` requests per scenario.

    Raises ValueError when the items do not give every level document sets of its own.
    """
    from ragsnap.prompt.assembly import encode_user_text

    def count(text: str) -> int:
        return len(encode_user_text(tokenizer, text))

    needed = prompts * len(levels)
    if len(items) < needed:
        raise ValueError(
            f"{needed} items needed ({prompts} prompts x {len(levels)} levels), {len(items)} loaded"
        )
    padding = list(items[needed:]) or list(items)
    workload: dict[int, dict[str, list[PeerRequest]]] = {}
    for li, level in enumerate(levels):
        cold: list[PeerRequest] = []
        new: list[PeerRequest] = []
        for i in range(prompts):
            item = items[li * prompts + i]
            pool = padding[(li * prompts + i) % len(padding) :] + padding
            docs = padded_documents(item, pool, context_tokens, count)
            cold.append(
                build_request(
                    item.id, item.question, docs, tokenizer, max_prompt_tokens, item.answers
                )
            )
            new.append(
                build_request(
                    f"{item.id}-new",
                    NEW_QUESTION.format(title=topic(item, docs)),
                    cold[-1].documents,  # the same ordered documents: only the question differs
                    tokenizer,
                    max_prompt_tokens,
                )
            )
        workload[level] = {"cold": cold, "repeated": list(cold), "new_question": new}
    return workload


def load_workload_items(
    fmt: str, data: Path, seed: int, context_tokens: int, tokenizer: Any
) -> list[EvalItem]:
    """Items of a data set in ``../shared/data`` layout: hotpotqa, bioasq, jsonl or niah."""
    from ragsnap.eval.datasets import load_items
    from ragsnap.prompt.assembly import encode_user_text

    if fmt == "niah":
        from ragsnap.eval.niah import build_needles

        loaded = build_needles(
            data,
            tokenizer,
            lengths=[context_tokens],
            depths=[10, 30, 50, 70, 90],
            samples=8,
            seed=seed,
            answer_prefix=False,
        )
    else:
        loaded = load_items(
            fmt,
            data,
            seed=seed,
            context_tokens=context_tokens,
            count_tokens=lambda text: len(encode_user_text(tokenizer, text)),
        )
    return [i for i in loaded.items if not i.answer_prefix]  # both servers get the bare question
