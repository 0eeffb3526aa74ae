"""What an evaluation item is, and how loaders report the items they could not use."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ragsnap.prompt.assembly import DEFAULT_DOCUMENT_ORDER, DocumentOrder, PromptLayout
from ragsnap.prompt.documents import Document
from ragsnap.prompt.order import fit_prompt

# How an item's answer is scored (see ragsnap.eval.metrics.score_answer).
ITEM_TYPES = ("yesno", "factoid", "list", "summary", "short", "needle")


@dataclass
class EvalItem:
    """One question over its documents, with what counts as a right answer.

    ``answers`` depends on ``type``: ``["yes"]``/``["no"]`` (yesno), synonyms of one entity
    (factoid, short, needle: the needle's value), ideal answers (summary); list items keep
    one synonym list per expected entity in ``answer_groups``. ``gold_doc_ids`` are the
    documents that hold the evidence (citations are scored against them).
    ``metadata`` carries builder facts, e.g. a needle's ``length``/``depth`` and the
    character span of the evidence inside its document (``evidence_doc_id``,
    ``evidence_span``).
    """

    id: str
    question: str
    documents: list[Document]
    type: str = "short"
    answers: list[str] = field(default_factory=list)
    answer_groups: list[list[str]] = field(default_factory=list)
    gold_doc_ids: list[str] = field(default_factory=list)
    answer_prefix: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)

    def prompt(
        self, runtime: Any, max_new_tokens: int, order: DocumentOrder = DEFAULT_DOCUMENT_ORDER
    ) -> PromptLayout:
        """This item's prompt for ``runtime``'s model, as a request would get it."""
        return fit_prompt(
            runtime.tokenizer,
            runtime.loaded.context_length,
            self.question,
            self.documents,
            max_new_tokens,
            order,
            answer_prefix=self.answer_prefix,
        )


@dataclass
class Malformed:
    """An item that was reported and skipped: where it was and why."""

    where: str
    reason: str

    def to_dict(self) -> dict[str, str]:
        return {"where": self.where, "reason": self.reason}


@dataclass
class LoadedItems:
    """A loader's result: the usable items and the problems it skipped."""

    items: list[EvalItem]
    malformed: list[Malformed] = field(default_factory=list)
