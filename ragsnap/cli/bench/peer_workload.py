"""The RAG workload of ``ragsnap bench peer``: the same prompts, token for token, for both servers.

Each request is a question over ordered documents. ragsnap gets the documents and the
question (``/v1/answer``); the peer gets the token ids of the prompt ragsnap builds from
them (:func:`ragsnap.prompt.assembly.assemble_prompt`: chat template, numbered documents, question
last), so both prefill the same tokens. The scenarios of a concurrency level:

- ``cold``: document sets neither server has seen;
- ``repeated``: the same requests again (ragsnap: exact cache hits; the peer: its prefix cache);
- ``new_question``: a new question over each already-seen document set (ragsnap: the
  document-prefix tier; the peer: its prefix cache over the shared document tokens);
- ``capacity``: as many fresh document sets as the level's concurrency (at least
  ``prompts``), all sent at once: how many long prompts a server holds in memory together;
- ``long_answer``: fresh document sets whose answers run to the bench's answer length
  (BioASQ summary and list questions ask for paragraphs).

Every concurrency level and every scenario that needs cold requests gets document sets of
its own, so its cold requests are cold.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ragsnap.eval.items import EvalItem
from ragsnap.prompt.documents import Document

SCENARIOS = ("cold", "repeated", "new_question", "capacity", "long_answer")
AFTER_COLD = ("repeated", "new_question")  # scenarios that reuse the level's cold requests
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


def fresh_count(scenario: str, level: int, prompts: int) -> int:
    """How many fresh document sets ``scenario`` takes at concurrency ``level``."""
    if scenario in AFTER_COLD:
        return 0
    return max(prompts, level) if scenario == "capacity" else prompts


def build_workload(
    items: Sequence[EvalItem],
    tokenizer: Any,
    *,
    levels: Sequence[int],
    prompts: int,
    context_tokens: int,
    max_prompt_tokens: int,
    scenarios: Sequence[str] = ("cold", "repeated", "new_question"),
) -> dict[int, dict[str, list[PeerRequest]]]:
    """``{concurrency: {scenario: requests}}``: ``prompts`` requests per scenario
    (``capacity``: the level's concurrency, if larger), every cold one on items of its own.

    Raises ValueError when the items do not give every level and scenario document sets of
    its own.
    """
    from ragsnap.prompt.assembly import encode_user_text

    def count(text: str) -> int:
        return len(encode_user_text(tokenizer, text))

    needed = sum(fresh_count(s, level, prompts) for level in levels for s in scenarios)
    if len(items) < needed:
        raise ValueError(
            f"{needed} items needed (fresh document sets for {', '.join(scenarios)} at "
            f"concurrency {', '.join(map(str, levels))}), {len(items)} loaded"
        )
    padding = list(items[needed:]) or list(items)
    taken = 0
    source: dict[str, EvalItem] = {}  # a cold request's item, whose topic a new question asks

    def cold_requests(n: int) -> list[PeerRequest]:
        nonlocal taken
        out = []
        for item in items[taken : taken + n]:
            pool = padding[taken % len(padding) :] + padding
            docs = padded_documents(item, pool, context_tokens, count)
            out.append(
                build_request(
                    item.id, item.question, docs, tokenizer, max_prompt_tokens, item.answers
                )
            )
            source[item.id] = item
            taken += 1
        return out

    workload: dict[int, dict[str, list[PeerRequest]]] = {}
    for level in levels:
        runs: dict[str, list[PeerRequest]] = {}
        for scenario in scenarios:
            if scenario == "repeated":
                runs[scenario] = list(runs["cold"])
            elif scenario == "new_question":
                runs[scenario] = [
                    new_question(r, source[r.id], tokenizer, max_prompt_tokens)
                    for r in runs["cold"]
                ]
            else:
                runs[scenario] = cold_requests(fresh_count(scenario, level, prompts))
        workload[level] = runs
    return workload


def new_question(
    cold: PeerRequest, item: EvalItem, tokenizer: Any, max_prompt_tokens: int
) -> PeerRequest:
    """A new question over ``cold``'s ordered documents (``item``'s): only the question
    differs, so the document prefix is shared."""
    return build_request(
        f"{cold.id}-new",
        NEW_QUESTION.format(title=topic(item, cold.documents)),
        cold.documents,
        tokenizer,
        max_prompt_tokens,
    )


def load_workload_items(
    fmt: str,
    data: Path,
    seed: int,
    context_tokens: int,
    tokenizer: Any,
    types: tuple[str, ...] | None = None,
) -> list[EvalItem]:
    """Items of a data set in ``../shared/data`` layout: hotpotqa, bioasq, jsonl or niah
    (``types``: only these BioASQ question types, e.g. ``summary``, ``list``)."""
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
            types=types,
        )
    return [i for i in loaded.items if not i.answer_prefix]  # both servers get the bare question
