"""Citations of one answer: attribution (or the model's own markers), with inline markers.

Shared by the engine and eval: what the answer cites, given the prompt it was written
over, the share of each prompt token the press kept, and (when the weights give it a say)
the answer's attention over the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ragsnap.citations import Citation, document_keep_shares, extract_citations
from ragsnap.citations.attribution import Evidence, answer_token_ends, attribute, gather_evidence
from ragsnap.citations.markers import insert_markers
from ragsnap.citations.options import CitationOptions
from ragsnap.citations.quotes import DocumentSentence, document_sentences
from ragsnap.prompt.assembly import PromptLayout


def cite_answer(
    tokenizer: Any,
    layout: PromptLayout,
    tokens: Sequence[int],
    question: str,
    keep_rate: torch.Tensor,
    options: CitationOptions,
    attention: Any = None,
) -> tuple[list[Citation], str | None]:
    """The citations of the answer ``tokens`` and, when ``options.inline_markers``, the
    answer with ``[n]`` markers after the sentences they back.

    ``keep_rate``: ``[prompt_tokens]``, the share of layers and heads that kept each token;
    ``attention``: the answer's attention over the prompt (``runtime.answer_attention``),
    None when the weights give attention no say.
    """
    answer = tokenizer.decode(list(tokens), skip_special_tokens=True)
    shares = document_keep_shares(keep_rate, layout.doc_spans)
    if options.mode == "markers" or not layout.documents:
        return extract_citations(answer, layout.documents, shares), None
    doc_sentences, evidence = answer_evidence(tokenizer, layout, tokens, question, attention)
    citations = attribute(
        answer,
        layout.documents,
        doc_sentences,
        evidence,
        options.weights,
        keep_rate=keep_rate.tolist(),
        doc_keep_shares=shares,
    )
    if not options.inline_markers:
        return citations, None
    per_sentence = [
        [c.index for c in citations if s in c.sentences] for s in range(len(evidence.sentences))
    ]
    spans = [(x.start, x.end) for x in evidence.sentences]
    return citations, insert_markers(answer, spans, per_sentence)


def answer_evidence(
    tokenizer: Any,
    layout: PromptLayout,
    tokens: Sequence[int],
    question: str,
    attention: Any = None,
) -> tuple[list[list[DocumentSentence]], Evidence]:
    """The prompt's document sentences and the evidence of each answer sentence for each
    document (overlap, question prior and, with ``attention``, the answer's attention)."""
    answer = tokenizer.decode(list(tokens), skip_special_tokens=True)
    doc_sentences = document_sentences(tokenizer, layout.documents, layout.doc_spans)
    evidence = gather_evidence(
        answer,
        question,
        layout.documents,
        doc_sentences,
        attention=attention,
        token_ends=answer_token_ends(tokenizer, list(tokens)),
        doc_spans=layout.doc_spans,
    )
    return doc_sentences, evidence
