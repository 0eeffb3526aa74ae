"""A corpus folder cut into passages with stable ids, ready for a retriever.

``.txt``/``.md`` files are split on blank lines and the paragraphs packed into passages
of at most ``max_words`` words; each ``.jsonl`` record (``{"id", "title", "text"}``) is
packed the same way. A passage id is ``<source>#<n>`` (``n`` from 1), where ``source``
is the file's path relative to the corpus root (or the record id for ``.jsonl``), so the
same folder always gives the same ids.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

from ragsnap.errors import InputError
from ragsnap.prompt.documents import Document

CORPUS_SUFFIXES = (".txt", ".md", ".jsonl")
DEFAULT_MAX_WORDS = 160
_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")

logger = logging.getLogger(__name__)


def split_passages(text: str, max_words: int = DEFAULT_MAX_WORDS) -> list[str]:
    """Pack the paragraphs of ``text`` into passages of at most ``max_words`` words.

    A paragraph longer than ``max_words`` is cut into word windows; paragraphs are never
    merged across that limit, and empty paragraphs disappear.
    """
    if max_words < 1:
        raise InputError("max_words must be at least 1", field="max_words")
    passages: list[str] = []
    current: list[str] = []
    count = 0
    for paragraph in _PARAGRAPH_BREAK.split(text):
        words = paragraph.split()
        if not words:
            continue
        if count and count + len(words) > max_words:
            passages.append("\n\n".join(current))
            current, count = [], 0
        while len(words) > max_words:
            passages.append(" ".join(words[:max_words]))
            words = words[max_words:]
        current.append(" ".join(words))
        count += len(words)
    if current:
        passages.append("\n\n".join(current))
    return passages


def _records(path: Path, relative: str) -> Iterator[tuple[str, str, str]]:
    """``(source id, title, text)`` for each document a corpus file holds."""
    try:
        content = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read corpus file {relative} ({exc.__class__.__name__})") from exc
    if path.suffix.lower() != ".jsonl":
        yield relative, path.stem, content
        return
    for lineno, line in enumerate(content.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{relative}:{lineno}: not valid JSON ({exc.msg})") from exc
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise InputError(f"{relative}:{lineno}: expected an object with a 'text' string")
        source = str(record.get("id", f"{relative}:{lineno}"))
        yield source, str(record.get("title", "")), record["text"]


def load_corpus(root: str | Path, max_words: int = DEFAULT_MAX_WORDS) -> list[Document]:
    """Every passage of every ``.txt``/``.md``/``.jsonl`` file under ``root``, in path order.

    Files and folders reached through a symlink that leads out of ``root`` are skipped
    (logged): a corpus folder never exposes other files of the server.
    Raises :class:`InputError` when ``root`` is not a folder, holds no passage, or two
    passages would share an id.
    """
    base = Path(root)
    if not base.is_dir():
        raise InputError(f"corpus folder not found: {base}", field="corpus")
    passages: list[Document] = []
    seen: set[str] = set()
    inside = base.resolve()
    files = []
    for p in sorted(base.rglob("*")):
        if not p.is_file() or p.suffix.lower() not in CORPUS_SUFFIXES:
            continue
        if not p.resolve().is_relative_to(inside):
            logger.warning("corpus: %s leads out of the corpus folder; skipped", p)
            continue
        files.append(p)
    for path in files:
        relative = path.relative_to(base).as_posix()
        for source, title, text in _records(path, relative):
            for number, passage in enumerate(split_passages(text, max_words), start=1):
                passage_id = f"{source}#{number}"
                if passage_id in seen:
                    raise InputError(
                        f"duplicate passage id {passage_id!r} in the corpus", field="corpus"
                    )
                seen.add(passage_id)
                metadata = {"source": relative, "chunk": number}
                passages.append(
                    Document(id=passage_id, text=passage, title=title, metadata=metadata)
                )
    if not passages:
        raise InputError(f"no .txt, .md or .jsonl text under {base}", field="corpus")
    return passages
