"""Structure of documents: detect JSON/JSONL, XML/HTML, Markdown tables and CSV, and tag tokens.

Each format is checked with a real parser (``json``, ``xml.etree``, ``html.parser``, ``csv``);
text that does not parse is prose, without error. A parsed document gets one
:class:`~ragsnap.compression.roles.TokenRole` per character, and each prompt token takes the
strongest role among its characters (VALUE > KEY > OTHER > DELIM > WS) through the
tokenizer's offset mapping, so ``' "'`` is a delimiter and ``' true'`` a value.
"""

from __future__ import annotations

import csv
import json
import logging
import re
import xml.etree.ElementTree as ET
from collections.abc import Callable
from html.parser import HTMLParser
from typing import Any

import torch

from ragsnap.compression.roles import TokenRole
from ragsnap.prompt.assembly import (
    PromptLayout,
    document_text_start,
    encode_user_text_with_offsets,
    format_document,
)
from ragsnap.prompt.documents import DOCUMENT_FORMATS, Document

logger = logging.getLogger(__name__)
# json's own string scanner (not in the typeshed stubs): (text, after-quote) -> (value, end)
scanstring: Callable[[str, int], tuple[str, int]] = json.decoder.scanstring  # type: ignore[attr-defined]

K, V, D, W, OT = TokenRole.KEY, TokenRole.VALUE, TokenRole.DELIM, TokenRole.WS, TokenRole.OTHER
# a token made of several characters takes the first of these its characters have
_PRIORITY = (TokenRole.VALUE, TokenRole.KEY, TokenRole.OTHER, TokenRole.DELIM, TokenRole.WS)
_RANK = {role: rank for rank, role in enumerate(_PRIORITY)}
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][-+]?\d+)?")
_LITERAL = re.compile(r"true|false|null")
_TABLE_SEPARATOR = re.compile(r"^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$")
ATTRIBUTE = re.compile(r"([^\s=/>]+)(\s*=\s*)?(\"[^\"]*\"|'[^']*'|[^\s>]+)?")

Roles = list[TokenRole]


def _ws_or(text: str, start: int, end: int, role: TokenRole, out: Roles) -> None:
    for i in range(start, end):
        out[i] = W if text[i].isspace() else role


# -- JSON / JSONL ---------------------------------------------------------------------


def _json_roles(text: str, out: Roles) -> None:
    """Lex JSON already validated by ``json.loads``: keys are strings followed by ``:``."""
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c.isspace():
            out[i] = W
            i += 1
        elif c in "{}[],:":
            out[i] = D
            i += 1
        elif c == '"':
            _, end = scanstring(text, i + 1)  # json's own string scanner: end is after the quote
            j = end
            while j < n and text[j].isspace():
                j += 1
            role = K if j < n and text[j] == ":" else V
            out[i] = out[end - 1] = D
            _ws_or(text, i + 1, end - 1, role, out)
            i = end
        else:
            match = _NUMBER.match(text, i) or _LITERAL.match(text, i)
            if match is None:
                raise ValueError(f"unexpected {c!r} at {i}")
            for p in range(i, match.end()):
                out[p] = V
            i = match.end()


def _tag_json(text: str) -> Roles:
    json.loads(text)
    out = [W] * len(text)
    _json_roles(text, out)
    return out


def _tag_jsonl(text: str) -> Roles:
    lines = [line for line in text.splitlines() if line.strip()]
    if len(lines) < 2:
        raise ValueError("JSON lines need at least two records")
    for line in lines:
        if not line.lstrip().startswith(("{", "[")):
            raise ValueError("a JSON line must hold an object or an array")
        json.loads(line)
    out = [W] * len(text)
    _json_roles(text, out)
    return out


# -- XML / HTML -----------------------------------------------------------------------


class MarkupSpans(HTMLParser):
    """Character spans of every tag, comment, declaration and processing instruction."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=False)
        self.text = text
        self.line_starts = [0] + [m.end() for m in re.finditer("\n", text)]
        self.spans: list[tuple[int, int, str]] = []  # (start, end, kind)
        self.opened: list[str] = []
        self.closed: list[str] = []

    def _here(self) -> int:
        line, column = self.getpos()
        return self.line_starts[line - 1] + column

    def _until(self, close: str, kind: str) -> None:
        start = self._here()
        end = self.text.index(close, start) + len(close)
        self.spans.append((start, end, kind))

    def handle_starttag(self, tag: str, attrs: Any) -> None:
        start = self._here()
        self.spans.append((start, start + len(self.get_starttag_text() or ""), "start"))
        self.opened.append(tag)

    def handle_startendtag(self, tag: str, attrs: Any) -> None:
        self.handle_starttag(tag, attrs)

    def handle_endtag(self, tag: str) -> None:
        self._until(">", "end")
        self.closed.append(tag)

    def handle_comment(self, data: str) -> None:
        self._until("-->", "other")

    def handle_decl(self, decl: str) -> None:
        self._until(">", "other")

    def handle_pi(self, data: str) -> None:
        self._until(">", "other")


def _tag_markup(text: str, *, xml: bool) -> Roles:
    if xml:
        ET.fromstring(text)  # well-formed XML, or ParseError
    parser = MarkupSpans(text)
    parser.feed(text)
    parser.close()
    if not xml and not set(parser.opened) & set(parser.closed):
        raise ValueError("no element is both opened and closed")
    out = [V] * len(text)  # element text between tags
    _ws_or(text, 0, len(text), V, out)
    for start, end, kind in parser.spans:
        if kind == "other":
            for p in range(start, end):
                out[p] = OT
            continue
        raw = text[start:end]
        _ws_or(text, start, end, D, out)  # brackets, slashes, quotes, '='
        name = re.match(r"</?\s*([^\s/>]+)", raw)
        if name is None:
            continue
        for p in range(start + name.start(1), start + name.end(1)):
            out[p] = K
        if kind == "start":
            for attr in ATTRIBUTE.finditer(raw, name.end(1)):
                for p in range(start + attr.start(1), start + attr.end(1)):
                    out[p] = K
                value = attr.group(3)
                if value:
                    quoted = value[0] in "\"'"
                    lo = start + attr.start(3) + int(quoted)
                    hi = start + attr.end(3) - int(quoted)
                    _ws_or(text, lo, hi, V, out)
    return out


# -- Markdown tables ------------------------------------------------------------------


def _cells(line: str) -> list[str]:
    body = line.strip()
    body = body[1:] if body.startswith("|") else body
    body = body[:-1] if body.endswith("|") else body
    return body.split("|")


def _tag_markdown_table(text: str) -> Roles:
    lines = text.splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    out = [OT] * len(text)
    found = False
    i = 0
    while i + 1 < len(lines):
        header, separator = lines[i], lines[i + 1]
        if not (
            "|" in header
            and _TABLE_SEPARATOR.match(separator.rstrip("\r\n"))
            and "-" in separator
            and len(_cells(header)) == len(_cells(separator))
        ):
            i += 1
            continue
        found = True
        j = i
        while j < len(lines) and "|" in lines[j] and lines[j].strip():
            role = K if j == i else (D if j == i + 1 else V)
            base = starts[j]
            for p, c in enumerate(lines[j]):
                out[base + p] = W if c.isspace() else (D if c == "|" else role)
            j += 1
        i = j
    if not found:
        raise ValueError("no Markdown table")
    return out


# -- CSV ------------------------------------------------------------------------------


def _tag_csv(text: str) -> Roles:
    lines = [line for line in text.splitlines() if line.strip()]
    if len(lines) < 2:
        raise ValueError("CSV needs a header and at least one row")
    dialect = csv.Sniffer().sniff(text[:4096], delimiters=",;\t|")
    delimiter, quote = dialect.delimiter, dialect.quotechar or '"'
    rows = list(csv.reader(text.splitlines(), delimiter=delimiter, quotechar=quote))
    rows = [r for r in rows if r]
    widths = {len(r) for r in rows}
    if len(widths) != 1 or widths.pop() < 2:
        raise ValueError("CSV rows differ in width")
    out = [W] * len(text)
    fields: list[list[str]] = [[]]
    current: list[str] = []
    quoted = False
    i, row = 0, 0
    while i < len(text):
        c = text[i]
        if quoted:
            if c == quote and text[i + 1 : i + 2] == quote:  # "" inside quotes
                out[i], out[i + 1] = D, V if row else K
                current.append(quote)
                i += 2
                continue
            if c == quote:
                quoted, out[i] = False, D
            else:
                out[i] = W if c.isspace() else (V if row else K)
                current.append(c)
        elif c == quote and not "".join(current).strip():
            quoted, out[i] = True, D
        elif c == delimiter:
            out[i] = D
            fields[-1].append("".join(current))
            current = []
        elif c in "\r\n":
            out[i] = W
            if c == "\n":
                if fields[-1] or current:
                    fields[-1].append("".join(current))
                    fields.append([])
                    row += 1
                current = []
        else:
            out[i] = W if c.isspace() else (V if row else K)
            current.append(c)
        i += 1
    if fields[-1] or current:
        fields[-1].append("".join(current))
    lexed = [f for f in fields if f]
    if [[c.strip() for c in r] for r in lexed] != [[c.strip() for c in r] for r in rows]:
        raise ValueError("CSV lexing disagrees with the csv module")
    return out


def _detect_csv(text: str) -> Roles:
    """CSV when nobody said so: stricter, since prose with commas sniffs as CSV too."""
    rows = [r for r in csv.reader(text.splitlines()) if r]
    cells = [c.strip() for r in rows for c in r]
    sentences = any(line.rstrip().endswith((".", "!", "?")) for line in text.splitlines())
    if len(rows) < 3 or sentences or sum(" " in c for c in cells) > len(cells) / 2:
        raise ValueError("looks like prose")
    return _tag_csv(text)


# -- detection and prompts ------------------------------------------------------------

_TAGGERS: dict[str, Callable[[str], Roles]] = {
    "json": _tag_json,
    "jsonl": _tag_jsonl,
    "xml": lambda t: _tag_markup(t, xml=True),
    "html": lambda t: _tag_markup(t, xml=False),
    "markdown": _tag_markdown_table,
    "csv": _tag_csv,
}


def _candidates(text: str) -> list[str]:
    head = text.lstrip()[:1]
    if head in "{[" and head:
        return ["json", "jsonl"]
    if head == "<":
        return ["xml", "html"]
    return ["markdown", "csv"]


def character_roles(text: str, fmt: str | None = None) -> tuple[str, Roles] | None:
    """The format of ``text`` and one role per character, or None for prose.

    ``fmt`` is a declared format (``json``, ``jsonl``, ``xml``, ``html``, ``markdown``,
    ``csv``, or ``text`` for prose); None detects it. Text that does not parse as its
    format is prose.
    """
    if fmt == "text" or not text.strip():
        return None
    for name in [fmt] if fmt else _candidates(text):
        tagger = _detect_csv if name == "csv" and not fmt else _TAGGERS[name]
        try:
            return name, tagger(text)
        except (ValueError, ET.ParseError, csv.Error, IndexError, KeyError, RecursionError) as exc:
            logger.debug("not %s: %s", name, exc)
    return None


def token_roles(
    text_roles: Roles, offsets: list[tuple[int, int]], text_start: int
) -> list[TokenRole]:
    """One role per token from per-character roles (tokens outside the text are OTHER)."""
    roles: list[TokenRole] = []
    for start, end in offsets:
        lo, hi = max(start - text_start, 0), min(end - text_start, len(text_roles))
        chars = text_roles[lo:hi] if hi > lo else []
        roles.append(min(chars, key=_RANK.__getitem__) if chars else OT)
    return roles


def document_token_spans(tokenizer: Any, index: int, document: Document) -> list[tuple[int, int]]:
    """Each prompt token's ``(start, end)`` in ``format_document(index, document)``: the
    tokens the prompt holds for that document (special-token strings cut as text, without
    touching the tokenizer's shared ``split_special_tokens`` state, which races between
    threads)."""
    return encode_user_text_with_offsets(tokenizer, format_document(index, document))[1]


def document_roles(tokenizer: Any, index: int, document: Document) -> list[TokenRole] | None:
    """Roles of the tokens of ``format_document(index, document)``, or None for prose."""
    text = document.text.strip()
    tagged = character_roles(text, document.format)
    if tagged is None:
        return None
    spans = document_token_spans(tokenizer, index, document)
    return token_roles(tagged[1], spans, document_text_start(index, document))


def prompt_roles(tokenizer: Any, layout: PromptLayout) -> torch.Tensor:
    """``[L]`` uint8 :class:`TokenRole` codes of a prompt: the head before the first document
    (the system instruction) is ``INSTRUCTION``, structured documents get their roles, the
    rest (prose, document headers, the question) is ``OTHER``."""
    if "roles" in layout.derived:  # computed once per request
        return layout.derived["roles"]
    roles = torch.zeros(layout.num_tokens, dtype=torch.uint8)
    head = layout.doc_spans[0][0] if layout.doc_spans else layout.prefix_len
    roles[:head] = TokenRole.INSTRUCTION
    for i, (document, (start, end)) in enumerate(
        zip(layout.documents, layout.doc_spans, strict=True)
    ):
        tagged = document_roles(tokenizer, i + 1, document)
        if tagged is None:
            continue
        n = min(end - start, len(tagged))  # a truncated document keeps its first tokens
        roles[start : start + n] = torch.tensor([int(r) for r in tagged[:n]], dtype=torch.uint8)
    layout.derived["roles"] = roles
    return roles


__all__ = ["DOCUMENT_FORMATS", "character_roles", "document_roles", "prompt_roles", "token_roles"]
