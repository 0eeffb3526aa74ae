"""The two short prompts that ask whether a quote backs an answer sentence (issue 43).

Both are the model's chat template with a short system line and the question; one also
holds the quote(s). The answer sentence (its citation markers removed) is the target: how
much likelier the quote makes it is its likelihood lift
(:func:`ragsnap.runtime.likelihood.mean_lift`). Pieces are capped so the check stays a
small share of an answer's time.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, NamedTuple

from ragsnap.prompt.assembly import _encode, _template_halves, encode_user_text

SUPPORT_SYSTEM = "Answer the question."
MAX_QUOTE_TOKENS = 64
MAX_QUESTION_TOKENS = 48
MAX_TARGET_TOKENS = 48
_MARKERS = re.compile(r"\s*(?:\[\d+\])+")


class SupportPrompts(NamedTuple):
    """Token ids: the prompt with the quotes, the prompt without, the target sentence;
    ``question``: where the question's tokens start in ``given`` and in ``alone``, and
    how many there are (both prompts hold it, so it is scored in the same rows)."""

    given: list[int]
    alone: list[int]
    target: list[int]
    question: tuple[int, int, int] = (0, 0, 0)


def support_prompts(
    tokenizer: Any, question: str, quotes: Sequence[str], sentence: str
) -> SupportPrompts:
    """The prompts of ``sentence`` (an answer sentence) given ``quotes`` and given none.

    Raises ``ValueError`` when there is no quote or the sentence is empty once its
    markers are removed."""
    target_text = _MARKERS.sub("", sentence).strip()
    quote_text = " ".join(q.strip() for q in quotes if q.strip())
    if not quote_text:
        raise ValueError("a support prompt needs at least one non-empty quote")
    if not target_text:
        raise ValueError("the answer sentence is empty")
    before, after = _template_halves(tokenizer, SUPPORT_SYSTEM)
    head, tail = _encode(tokenizer, before), _encode(tokenizer, after)
    asked = encode_user_text(tokenizer, f"Question: {question.strip()}")[:MAX_QUESTION_TOKENS]
    quoted = encode_user_text(tokenizer, f"Document: {quote_text}\n\n")[:MAX_QUOTE_TOKENS]
    target = encode_user_text(tokenizer, target_text)[:MAX_TARGET_TOKENS]
    where = (len(head) + len(quoted), len(head), len(asked))
    return SupportPrompts(head + quoted + asked + tail, head + asked + tail, target, where)


def question_prompts(tokenizer: Any, question: str, quotes: Sequence[str]) -> SupportPrompts:
    """The prompts that ask how much ``quotes`` make the question itself likelier (does
    the cited text speak of what is asked?): the same chat template and system line, the
    user turn opening with the quotes or with nothing, the question (capped) the target.
    They are the beginnings of :func:`support_prompts`' two prompts (the engine reads the
    question there, in the sentence's pass; ``SupportPrompts.question``).

    Raises ``ValueError`` when there is no quote or no question."""
    quote_text = " ".join(q.strip() for q in quotes if q.strip())
    if not quote_text:
        raise ValueError("a question prompt needs at least one non-empty quote")
    if not question.strip():
        raise ValueError("the question is empty")
    before, _ = _template_halves(tokenizer, SUPPORT_SYSTEM)
    head = _encode(tokenizer, before)
    quoted = encode_user_text(tokenizer, f"Document: {quote_text}\n\n")[:MAX_QUOTE_TOKENS]
    target = encode_user_text(tokenizer, f"Question: {question.strip()}")[:MAX_QUESTION_TOKENS]
    return SupportPrompts(head + quoted, head, target)
