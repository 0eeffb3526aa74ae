"""Documents: the unit ragsnap cites, and loading them from files."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ragsnap.errors import InputError

TEXT_SUFFIXES = (".txt", ".md")
# declared document formats (see ragsnap.prompt.structure); "text" is prose, None detects the format
DOCUMENT_FORMATS = ("json", "jsonl", "xml", "html", "markdown", "csv", "text")


@dataclass(frozen=True)
class Document:
    """One retrieved document. ``id`` is stable and unique within a request.

    ``format`` declares how the text is structured (one of :data:`DOCUMENT_FORMATS`);
    None lets :mod:`ragsnap.prompt.structure` detect it.
    """

    id: str
    text: str
    title: str = ""
    metadata: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    format: str | None = None

    def __post_init__(self) -> None:
        if self.format is not None and self.format not in DOCUMENT_FORMATS:
            raise InputError(
                f"unknown document format {self.format!r} "
                f"(choose from: {', '.join(DOCUMENT_FORMATS)})",
                field="format",
            )

    @property
    def content_hash(self) -> str:
        """sha256 of title and text (and the declared format, when there is one): what
        the cache key depends on (not the id)."""
        parts = [self.title, self.text] + ([self.format] if self.format is not None else [])
        payload = json.dumps(parts, ensure_ascii=False)
        return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def _document_from_record(record: Any, where: str, default_id: str) -> Document:
    if not isinstance(record, dict):
        raise InputError(f"{where}: expected a JSON object with a 'text' field")
    text = record.get("text")
    if not isinstance(text, str) or not text.strip():
        raise InputError(f"{where}: 'text' must be a non-empty string")
    doc_id = record.get("id", default_id)
    title = record.get("title", "")
    if not isinstance(doc_id, (str, int)) or not isinstance(title, str):
        raise InputError(f"{where}: 'id' must be a string or number and 'title' a string")
    fmt = record.get("format")
    if fmt is not None and fmt not in DOCUMENT_FORMATS:
        raise InputError(
            f"{where}: 'format' must be one of {', '.join(DOCUMENT_FORMATS)}, got {fmt!r}"
        )
    metadata = {k: v for k, v in record.items() if k not in {"id", "title", "text", "format"}}
    return Document(id=str(doc_id), text=text, title=title, metadata=metadata, format=fmt)


def load_documents(paths: Iterable[str | Path]) -> list[Document]:
    """Read documents from ``.txt``/``.md`` files (one each, titled by file name) and
    ``.jsonl`` files (``{"id", "title", "text", "format"?}`` per line), in the order given.

    Raises :class:`InputError` naming the file (and line) that could not be used.
    """
    documents: list[Document] = []
    for raw in paths:
        path = Path(raw)
        if not path.is_file():
            raise InputError(f"document file not found: {path}", field="docs")
        suffix = path.suffix.lower()
        try:
            content = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise InputError(
                f"cannot read {path} as UTF-8 text ({exc.__class__.__name__})"
            ) from exc
        if suffix in TEXT_SUFFIXES:
            if not content.strip():
                raise InputError(f"document file is empty: {path}", field="docs")
            documents.append(Document(id=path.stem, title=path.stem, text=content.strip()))
        elif suffix == ".jsonl":
            for lineno, line in enumerate(content.splitlines(), start=1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise InputError(f"{where}: not valid JSON ({exc.msg})") from exc
                documents.append(_document_from_record(record, where, f"{path.stem}-{lineno}"))
        else:
            raise InputError(
                f"unsupported document file type '{suffix or path.name}' for {path} "
                "(use .txt, .md or .jsonl)",
                field="docs",
            )
    ids = [d.id for d in documents]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise InputError(f"duplicate document ids: {', '.join(duplicates[:5])}", field="docs")
    return documents
