"""Model-written ``[n]`` markers: parsing them, and keeping them valid while decoding."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch

# [1], [2, 3], [1-2] is not a citation style we ask for; "[2][3]" is two markers
MARKER = re.compile(r"\[(\d{1,4}(?:\s*,\s*\d{1,4})*)\]")
# what may follow an opening bracket: numbers separated by commas, then the closing bracket
_INSIDE_PREFIX = re.compile(r"^\s*(\d+(\s*,\s*\d+)*\s*,?\s*)?$")
_INSIDE_CLOSED = re.compile(r"^\s*(\d+(\s*,\s*\d+)*)\s*\]")


def cited_indices(answer: str) -> list[int]:
    """Numbers inside ``[n]`` / ``[n, m]`` markers, in order of first appearance, unique."""
    seen: list[int] = []
    for match in MARKER.finditer(answer):
        for part in match.group(1).split(","):
            number = int(part)
            if number not in seen:
                seen.append(number)
    return seen


def marker_numbers_in(text: str) -> list[int]:
    """Every number inside a marker of ``text`` (repeats kept)."""
    return [int(p) for m in MARKER.finditer(text) for p in m.group(1).split(",")]


def strip_markers(text: str) -> str:
    """``text`` without its ``[n]`` markers."""
    return MARKER.sub("", text)


def _numbers_ok(inside: str, count: int, closed: bool) -> bool:
    digits = re.findall(r"\d+", inside)
    if not closed and digits and not re.search(r"[\s,]$", inside):
        # the last number may still grow: it must be a prefix of some valid number
        *whole, last = digits
        if not any(str(n).startswith(last) for n in range(1, count + 1)):
            return False
        digits = whole
    return all(1 <= int(d) <= count for d in digits)


_CONTINUES_MARKER = re.compile(r"(?:[\d,]| (?! ))*(\].*)?", re.S)


def marker_candidates(token_texts: Sequence[str]) -> list[int]:
    """Ids of the tokens that could continue an open marker: digits, commas and single
    spaces, then maybe ``]`` and anything after it."""
    return [i for i, t in enumerate(token_texts) if t and _CONTINUES_MARKER.fullmatch(t)]


class MarkerConstraint:
    """A per-row logits processor: after ``[`` only document numbers ``1..count``, commas
    and ``]`` may follow, so the model cannot cite a document that was not given.

    Parameters
    ----------
    token_texts : the decoded text of every vocabulary token (see :func:`vocabulary_texts`).
    count : how many documents the prompt numbers.
    candidates : :func:`marker_candidates` of ``token_texts``, when the caller keeps them
        (scanning a 49K-token vocabulary takes about 0.3 s per answer otherwise).

    Call it with the row's tokens so far and its next-token logits ``[1, V]``; it returns
    the logits with every token that would break an open marker set to ``-inf``.
    """

    def __init__(
        self, token_texts: Sequence[str], count: int, candidates: Sequence[int] | None = None
    ) -> None:
        self.token_texts = token_texts
        self.count = count
        self._seen = 0
        self._tail = ""  # generated text since the last "[" or "]"
        self._open = False
        self._candidates = marker_candidates(token_texts) if candidates is None else candidates

    def _advance(self, tokens: Sequence[int]) -> None:
        for token in tokens[self._seen :]:
            for ch in self.token_texts[token]:
                if ch == "[":
                    self._open, self._tail = True, ""
                elif ch == "]":
                    self._open, self._tail = False, ""
                elif self._open:
                    self._tail += ch
        self._seen = len(tokens)

    def allowed(self) -> list[int]:
        """Tokens that keep the open marker valid (the current state; call after advancing)."""
        out = []
        for i in self._candidates:
            text = self._tail + self.token_texts[i]
            if "]" in text:
                if _INSIDE_CLOSED.match(text) and _numbers_ok(text.split("]")[0], self.count, True):
                    out.append(i)
            elif _INSIDE_PREFIX.match(text) and _numbers_ok(text, self.count, False):
                out.append(i)
        return out

    def __call__(self, tokens: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        self._advance(tokens)
        if not self._open:
            return logits
        allowed = self.allowed()
        if len(self._tail) > 24 or not allowed:  # cannot happen with digit tokens; stay safe
            allowed = [i for i in self._candidates if self.token_texts[i].lstrip().startswith("]")]
        masked = torch.full_like(logits, float("-inf"))
        index = torch.tensor(allowed, dtype=torch.long, device=logits.device)
        masked[..., index] = logits[..., index]
        return masked


def vocabulary_texts(tokenizer: Any) -> list[str]:
    """Each token id's text as it appears in decoded output (special tokens: empty)."""
    size = len(tokenizer)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    return [
        "" if i in special else tokenizer.decode([i], skip_special_tokens=True) for i in range(size)
    ]


def insert_markers(
    answer: str, spans: Sequence[tuple[int, int]], cited: Sequence[Sequence[int]]
) -> str:
    """``answer`` with `` [n]`` added after sentence ``i`` (``spans[i]`` = ``[start, end)``)
    for every number of ``cited[i]`` the sentence does not already carry."""
    out, at = [], 0
    for (start, end), numbers in zip(spans, cited, strict=True):
        present = set(marker_numbers_in(answer[start:end]))
        missing = [n for n in numbers if n not in present]
        if not missing:
            continue
        body = answer[at:end]
        stripped = body.rstrip(".!?")
        tail = body[len(stripped) :]
        out.append(stripped + "".join(f" [{n}]" for n in missing) + tail)
        at = end
    out.append(answer[at:])
    return "".join(out)
