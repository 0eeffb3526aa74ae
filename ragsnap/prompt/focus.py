"""Query-aware structure: the record of a structured document that the question names.

A lookup question names what it asks about ("what is the value of key K", "the price of
item X"), and on a structured document that name is a key, an attribute or a cell of one
record. A small model's question attention barely singles that record out, so a 5% budget
spreads over every record; a lexical vote finds it instead:

1. the document is parsed (:mod:`ragsnap.prompt.structure` detects the format) into *atoms* (JSON
   keys and scalars, XML tag and attribute names and values and element text, table and
   CSV cells), each with the *record* it identifies (the member under a key that holds a
   nested record, or a member of a large key-value object; the small object around a
   scalar; the XML element, or its parent for element text; the table row) and its *field*
   (the member, element or cell). Field names (keys of scalars in small objects, tag and
   attribute names, table headers) describe; the other atoms name;
2. an atom matches when its words occur contiguously in the question's words; a record
   scores the sum over its matched naming atoms of ``characters / occurrences``;
3. a record is a candidate when it holds a match that few records share (at most
   :data:`MAX_NAME_FREQUENCY` occurrences, and at most half the records): the question
   names it; candidates scoring at least half the best one are chosen (at most
   :data:`MAX_RECORDS`).

Each token of a chosen record gets a focus tier: 1 for the record, 2 for its value
tokens, +2 inside a field the question names (a member, child element or column whose key
matches a question word). Everything else, prose and documents without a match, is tier 0.
Deterministic; text that does not parse gives no focus.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

import torch

from ragsnap.compression.roles import TokenRole
from ragsnap.prompt.assembly import PromptLayout, document_text_start
from ragsnap.prompt.documents import Document
from ragsnap.prompt.structure import (
    ATTRIBUTE,
    MarkupSpans,
    character_roles,
    document_token_spans,
    scanstring,
)

logger = logging.getLogger(__name__)

MAX_NAME_FREQUENCY = 3  # a name that occurs more often does not single out a record
MAX_RECORDS = 4
RECORD_SHARE = 0.5  # records scoring at least this share of the best are chosen
MAX_RECORD_SHARE = 0.5  # a "record" spanning more of the document than this is no record
STOPWORDS = frozenset(
    "a an the of is are was were be what which who whom whose how when where in on at for "
    "to from and or by with does do did it its this that as".split()
)
_WORD = re.compile(r"[0-9a-z]+")
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][-+]?\d+)?|true|false|null")

Span = tuple[int, int]


@dataclass
class Atom:
    """One identifier of a structured document: its character span, whether it names a
    field (JSON key, XML tag or attribute name, table header) and the spans it belongs to."""

    start: int
    end: int
    text: str
    is_key: bool
    record: Span | None  # what the atom identifies when the question names it (None: nothing)
    field: Span  # the member, element or cell the atom is part of
    column: int | None = None  # table/CSV column of a cell


def words(text: str) -> list[str]:
    """Lower-case alphanumeric runs: ``"Brave-Otter 42"`` -> ``["brave", "otter", "42"]``."""
    return _WORD.findall(text.lower())


# -- atoms per format -----------------------------------------------------------------


def _json_atoms(text: str) -> list[Atom]:
    """Atoms of JSON (or JSON lines) that :mod:`json` already validated."""
    atoms: list[Atom] = []
    limit = MAX_RECORD_SHARE * max(len(text), 1)

    def skip(i: int) -> int:
        while i < len(text) and text[i].isspace():
            i += 1
        return i

    def scalar(i: int) -> tuple[int, int, str]:
        if text[i] == '"':
            value, after = scanstring(text, i + 1)
            return i + 1, after - 1, value  # the atom is the string's inside
        match = _NUMBER.match(text, i)
        if match is None:
            raise ValueError(f"unexpected {text[i]!r} at {i}")
        return i, match.end(), match.group()

    def end_of(span_end: int) -> int:  # past a string's closing quote
        return span_end + 1 if span_end < len(text) and text[span_end] == '"' else span_end

    def parse(i: int) -> int:
        """Parse the value at ``i``; returns where it ends."""
        i = skip(i)
        if text[i] == "{":
            return composite(i, "}")
        if text[i] == "[":
            return composite(i, "]")
        lo, hi, literal = scalar(i)
        atoms.append(Atom(lo, hi, literal, False, None, (lo, hi)))
        return end_of(hi)

    def composite(i: int, closing: str) -> int:
        start = i
        direct: list[tuple[int, bool]] = []  # scalars (and their keys) of this object/array
        i = skip(i + 1)
        while text[i] != closing:
            if closing == "}":
                lo, hi, name = scalar(i)
                key = len(atoms)
                atoms.append(Atom(lo, hi, name, True, None, (lo, hi)))
                i = skip(end_of(hi))
                if text[i] != ":":
                    raise ValueError(f"expected ':' at {i}")
                at = skip(i + 1)
                i = parse(at)
                member = (lo - 1, i)
                atoms[key].field = member
                atoms[key].record = member if member[1] - member[0] <= limit else None
                atoms[key].is_key = False  # a key over a nested record names it
                if text[at] not in "{[":
                    atoms[key + 1].field = member
                    direct.extend([(key, True), (key + 1, False)])
            else:
                at = i
                i = parse(at)
                if text[at] not in "{[":
                    direct.append((len(atoms) - 1, False))
            i = skip(i)
            if text[i] == ",":
                i = skip(i + 1)
        own = (start, i + 1)
        small = own[1] - own[0] <= limit
        for index, is_key in direct:  # in a small object a scalar's key names its field
            atoms[index].record = own if small else atoms[index].field
            atoms[index].is_key = small and is_key
        return i + 1

    i = skip(0)
    while i < len(text):
        i = skip(parse(i))
    return atoms


def _markup_atoms(text: str) -> list[Atom]:
    """Tag names, attribute names and values, and element text of XML or HTML."""
    parser = MarkupSpans(text)
    parser.feed(text)
    parser.close()
    limit = MAX_RECORD_SHARE * max(len(text), 1)
    spans: dict[int, list[int]] = {}  # element id (its start tag's start) -> [start, end]
    parent: dict[int, int | None] = {}
    # (start, end, is_key, element, whether the record is the parent element)
    pending: list[tuple[int, int, bool, int, bool]] = []
    stack: list[tuple[str, int]] = []
    previous_end = 0
    for start, end, kind in sorted(parser.spans):
        chunk = text[previous_end:start]
        if chunk.strip() and stack:  # element text: belongs to the innermost open element
            lo = previous_end + len(chunk) - len(chunk.lstrip())
            hi = start - (len(chunk) - len(chunk.rstrip()))
            pending.append((lo, hi, False, stack[-1][1], True))
        previous_end = max(previous_end, end)
        raw = text[start:end]
        name = re.match(r"</?\s*([^\s/>]+)", raw)
        if kind == "other" or name is None:
            continue
        tag = name.group(1).lower()
        if kind == "end":
            for depth in range(len(stack) - 1, -1, -1):
                if stack[depth][0] == tag:
                    spans[stack[depth][1]][1] = end
                    del stack[depth:]
                    break
            continue
        spans[start] = [start, end]
        parent[start] = stack[-1][1] if stack else None
        pending.append((start + name.start(1), start + name.end(1), True, start, True))
        for attr in ATTRIBUTE.finditer(raw, name.end(1)):
            pending.append((start + attr.start(1), start + attr.end(1), True, start, False))
            if attr.group(3):
                quoted = attr.group(3)[0] in "\"'"
                lo = start + attr.start(3) + int(quoted)
                hi = start + attr.end(3) - int(quoted)
                pending.append((lo, hi, False, start, False))
        if not raw.rstrip(">").rstrip().endswith("/"):
            stack.append((tag, start))

    def record(element: int | None) -> Span | None:
        if element is None:
            return None
        lo, hi = spans[element]
        return (lo, hi) if hi - lo <= limit else None

    atoms: list[Atom] = []
    for lo, hi, is_key, element, up in pending:
        own = (spans[element][0], spans[element][1])
        chosen = (record(parent[element]) or record(element)) if up else record(element)
        atoms.append(Atom(lo, hi, text[lo:hi], is_key, chosen, own))
    return atoms


def _cell_atoms(text: str, roles: list[TokenRole], separator: str) -> list[Atom]:
    """Table and CSV cells, split at ``separator`` characters tagged DELIM; the header's
    cells (KEY) name columns, every other line is a record."""
    atoms: list[Atom] = []
    offset = 0
    for line in text.splitlines(keepends=True):
        row = (offset, offset + len(line.rstrip("\r\n")))
        offset += len(line)
        cuts = [p for p in range(*row) if text[p] == separator and roles[p] == TokenRole.DELIM]
        cells = list(zip([row[0] - 1, *cuts], [*cuts, row[1]], strict=True))
        if separator == "|" and text[row[0] : row[1]].lstrip().startswith("|"):
            cells = cells[1:]
        for column, (left, right) in enumerate(cells):
            inner = [
                p for p in range(left + 1, right) if roles[p] in (TokenRole.KEY, TokenRole.VALUE)
            ]
            if not inner:
                continue
            lo, hi = inner[0], inner[-1] + 1
            header = roles[lo] == TokenRole.KEY
            atoms.append(
                Atom(lo, hi, text[lo:hi], header, None if header else row, (lo, hi), column)
            )
    return atoms


def document_atoms(text: str, fmt: str | None = None) -> tuple[list[Atom], list[TokenRole]] | None:
    """The atoms of ``text`` and its per-character roles, or None for prose (or text that
    does not parse as its format)."""
    tagged = character_roles(text, fmt)
    if tagged is None:
        return None
    name, roles = tagged
    try:
        if name in ("json", "jsonl"):
            atoms = _json_atoms(text)
        elif name in ("xml", "html"):
            atoms = _markup_atoms(text)
        else:
            separator = "|" if name == "markdown" else _csv_separator(text, roles)
            atoms = _cell_atoms(text, roles, separator)
    except (ValueError, IndexError, KeyError, RecursionError) as exc:
        logger.debug("no atoms for %s: %s", name, exc)
        return None
    return atoms, roles


def _csv_separator(text: str, roles: list[TokenRole]) -> str:
    """The commonest DELIM character of a CSV text that is not a quote."""
    counts: dict[str, int] = {}
    for c, role in zip(text, roles, strict=True):
        if role == TokenRole.DELIM and c not in "\"'":
            counts[c] = counts.get(c, 0) + 1
    if not counts:
        raise ValueError("no CSV separator")
    return max(sorted(counts), key=counts.__getitem__)


# -- matching -------------------------------------------------------------------------


def _contains(haystack: list[str], needle: list[str]) -> bool:
    n = len(needle)
    return any(haystack[i : i + n] == needle for i in range(len(haystack) - n + 1))


def _names(atom_words: list[str], question: list[str]) -> bool:
    """Whether the question holds the atom's words, contiguously (stopwords alone do not count)."""
    if not atom_words or all(w in STOPWORDS for w in atom_words):
        return False
    return _contains(question, atom_words)


def _outermost(atoms: list[Atom]) -> int:
    """How many records are not inside another record."""
    count, reach = 0, -1
    for _lo, hi in sorted(
        {a.record for a in atoms if a.record is not None}, key=lambda r: (r[0], -r[1])
    ):
        if hi > reach:
            count += 1
            reach = hi
    return count


def _inside(span: Span, record: Span) -> bool:
    return record[0] <= span[0] and span[1] <= record[1] and span != record


def focus_chars(text: str, question: str, fmt: str | None = None) -> list[int] | None:
    """One focus tier per character of ``text`` (0-4, see the module docstring), or None
    when the text is prose or the question names no record of it."""
    parsed = document_atoms(text, fmt)
    if parsed is None:
        return None
    atoms, roles = parsed
    asked = words(question)
    normal = [words(a.text) for a in atoms]
    frequency: dict[tuple[str, ...], int] = {}
    for atom_words in normal:
        frequency[tuple(atom_words)] = frequency.get(tuple(atom_words), 0) + 1
    matched = [i for i, atom_words in enumerate(normal) if _names(atom_words, asked)]
    scores: dict[Span, float] = {}
    rarest: dict[Span, int] = {}  # record -> fewest occurrences among its matched atoms
    for i in matched:
        record = atoms[i].record
        if record is None or atoms[i].is_key:  # field names describe, values name
            continue
        count = frequency[tuple(normal[i])]
        scores[record] = scores.get(record, 0.0) + len(" ".join(normal[i])) / count
        rarest[record] = min(rarest.get(record, count), count)
    # a name singles out a record when few records hold it (never one that most records share)
    limit = min(MAX_NAME_FREQUENCY, max(1, _outermost(atoms) // 2))
    ranked = sorted((r for r in scores if rarest[r] <= limit), key=lambda r: (-scores[r], r))
    if not ranked:
        return None
    best = ranked[0]
    chosen = [r for r in ranked if scores[r] >= RECORD_SHARE * scores[best]][:MAX_RECORDS]
    # fields the question names inside a chosen record: members, child elements, columns
    named_fields = [atoms[i].field for i in matched if atoms[i].is_key and atoms[i].column is None]
    columns = {atoms[i].column for i in matched if atoms[i].is_key and atoms[i].column is not None}
    fields = [f for f in named_fields if any(_inside(f, r) for r in chosen)]
    fields += [a.field for a in atoms if a.column in columns and a.record in chosen]
    tiers = [0] * len(text)
    for lo, hi in chosen:
        for p in range(lo, hi):
            tiers[p] = 1 + int(roles[p] == TokenRole.VALUE)
    for lo, hi in fields:
        for p in range(lo, hi):
            if tiers[p]:
                tiers[p] = 3 + int(roles[p] == TokenRole.VALUE)
    return tiers


def document_focus(
    tokenizer: Any, index: int, document: Document, question: str
) -> list[int] | None:
    """Focus tiers of the tokens of ``format_document(index, document)``, or None."""
    text = document.text.strip()
    tiers = focus_chars(text, question, document.format)
    if tiers is None:
        return None
    text_start = document_text_start(index, document)
    out: list[int] = []
    for start, end in document_token_spans(tokenizer, index, document):
        lo, hi = max(start - text_start, 0), min(end - text_start, len(tiers))
        out.append(max(tiers[lo:hi], default=0) if hi > lo else 0)
    return out


def question_text(tokenizer: Any, layout: PromptLayout) -> str:
    """What follows the documents in the prompt: the question (and chat context, answer
    prefix and the template's few words)."""
    return str(tokenizer.decode(layout.input_ids[layout.prefix_len :], skip_special_tokens=True))


def prompt_focus(tokenizer: Any, layout: PromptLayout) -> torch.Tensor | None:
    """``[L]`` uint8 focus tiers of a prompt (0 outside the records its question names),
    or None when no structured document has a record the question names."""
    if "focus" not in layout.derived:  # computed once per request
        layout.derived["focus"] = _prompt_focus(tokenizer, layout)
    return layout.derived["focus"]


def _prompt_focus(tokenizer: Any, layout: PromptLayout) -> torch.Tensor | None:
    question = question_text(tokenizer, layout)
    focus = torch.zeros(layout.num_tokens, dtype=torch.uint8)
    found = False
    for i, (document, (start, end)) in enumerate(
        zip(layout.documents, layout.doc_spans, strict=True)
    ):
        tiers = document_focus(tokenizer, i + 1, document, question)
        if tiers is None or not any(tiers):
            continue
        n = min(end - start, len(tiers))  # a truncated document keeps its first tokens
        focus[start : start + n] = torch.tensor(tiers[:n], dtype=torch.uint8)
        found = found or bool(focus[start : start + n].any())
    return focus if found else None


__all__ = ["Atom", "document_atoms", "document_focus", "focus_chars", "prompt_focus", "words"]
