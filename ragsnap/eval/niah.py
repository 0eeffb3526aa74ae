"""Needle-in-a-haystack items, RULER style: a 7-digit "special magic number" in filler text.

The haystack is a folder of text files (read in name order, split into sentences). For
each prompt length, depth and sample, a seeded window of the haystack is cut into
documents of about ``chunk_tokens`` tokens, the needle sentence is inserted at the sentence
boundary closest to ``depth`` percent of the haystack tokens, and the whole prompt is fitted
to the target length. The question asks for the number; an optional answer prefix
("The special magic number for X mentioned in the provided text is") is pre-filled.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ragsnap.errors import InputError
from ragsnap.eval.items import EvalItem, LoadedItems, Malformed
from ragsnap.prompt.assembly import assemble_prompt
from ragsnap.prompt.documents import Document

NEEDLE = "One of the special magic numbers for {key} is: {value}."
QUESTION = "What is the special magic number for {key} mentioned in the provided text?"
ANSWER_PREFIX = "The special magic number for {key} mentioned in the provided text is"
_ADJECTIVES = (
    "amber",
    "brave",
    "calm",
    "dusty",
    "eager",
    "faint",
    "gentle",
    "hollow",
    "icy",
    "jolly",
    "keen",
    "lively",
    "misty",
    "noble",
    "odd",
    "proud",
    "quiet",
    "rapid",
    "silent",
    "tidy",
)
_NOUNS = (
    "anchor",
    "badger",
    "candle",
    "dolphin",
    "engine",
    "falcon",
    "garden",
    "harbor",
    "island",
    "jacket",
    "kettle",
    "lantern",
    "meadow",
    "needle",
    "orchid",
    "pebble",
    "quarry",
    "river",
    "saddle",
    "tunnel",
)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


@dataclass(frozen=True)
class Needle:
    key: str
    value: str
    needle: str = NEEDLE
    question: str = QUESTION
    answer_prefix: str = ANSWER_PREFIX


@dataclass
class _Sentence:
    text: str
    tokens: int
    source: str


def load_needles(path: Path) -> list[Needle]:
    """JSONL with ``{"key", "value"}`` per line, optionally ``needle``/``question``/
    ``answer_prefix`` templates using ``{key}`` and ``{value}``."""
    needles = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record: Any = json.loads(line)
            needles.append(Needle(**{k: str(v) for k, v in record.items()}))
        except (json.JSONDecodeError, TypeError) as exc:
            raise InputError(
                f"{path}:{lineno}: a needle needs 'key' and 'value' ({exc})", field="needles"
            ) from exc
    if not needles:
        raise InputError(f"no needles in {path}", field="needles")
    return needles


def item_rng(seed: int, item_id: str) -> random.Random:
    """A generator of its own per item, so an item is the same whatever else is generated."""
    digest = hashlib.sha256(f"{seed}:{item_id}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def _random_needle(rng: random.Random) -> Needle:
    key = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"
    return Needle(key=key, value=str(rng.randint(1_000_000, 9_999_999)))


def read_haystack(folder: Path, tokenizer: Any) -> list[_Sentence]:
    """Sentences of every ``*.txt`` file in ``folder`` (name order), with token counts."""
    files = sorted(folder.glob("*.txt")) if folder.is_dir() else []
    files = [f for f in files if not f.name.upper().startswith("LICENSE")]
    if not files:
        raise InputError(f"no .txt haystack files in {folder}", field="haystack")
    sentences: list[_Sentence] = []
    for file in files:
        text = " ".join(file.read_text(encoding="utf-8", errors="replace").split())
        pieces = [p for p in _SENTENCE_END.split(text) if p.strip()]
        counts = tokenizer(pieces, add_special_tokens=False)["input_ids"] if pieces else []
        sentences += [_Sentence(p, len(c), file.stem) for p, c in zip(pieces, counts, strict=True)]
    return sentences


def _documents(
    sentences: list[_Sentence], chunk_tokens: int, needle: str, mark: int
) -> list[Document]:
    """Consecutive sentences grouped into documents of about ``chunk_tokens`` tokens (a new
    document at each new source file), with ``needle`` inserted before ``sentences[mark]``
    (after the last sentence when ``mark == len(sentences)``)."""
    groups: list[list[str]] = []
    titles: list[str] = []
    size = 0
    for k, sentence in enumerate(sentences):
        if not groups or size + sentence.tokens > chunk_tokens or sentence.source != titles[-1]:
            groups.append([])
            titles.append(sentence.source)
            size = 0
        if k == mark:
            groups[-1].append(needle)
        groups[-1].append(sentence.text)
        size += sentence.tokens
    if mark >= len(sentences):
        groups[-1].append(needle)
    return [
        Document(id=f"p{i + 1}", title=t, text=" ".join(g))
        for i, (t, g) in enumerate(zip(titles, groups, strict=True))
    ]


def _build_one(
    haystack: list[_Sentence],
    needle: Needle,
    tokenizer: Any,
    length: int,
    depth: float,
    start: int,
    chunk_tokens: int,
    use_prefix: bool,
) -> EvalItem:
    needle_text = needle.needle.format(key=needle.key, value=needle.value)
    question = needle.question.format(key=needle.key, value=needle.value)
    prefix = needle.answer_prefix.format(key=needle.key, value=needle.value) if use_prefix else ""

    def build(count: int) -> tuple[int, list[Document]]:
        """The prompt with the first ``count`` haystack sentences from ``start``."""
        chosen = [haystack[(start + k) % len(haystack)] for k in range(count)]
        total = sum(s.tokens for s in chosen)
        mark, cumulative = len(chosen), 0
        for k, sentence in enumerate(chosen):
            if cumulative >= depth / 100 * total:
                mark = k
                break
            cumulative += sentence.tokens
        documents = _documents(chosen, chunk_tokens, needle_text, mark)
        layout = assemble_prompt(
            tokenizer, question, documents, max_prompt_tokens=10 * length, answer_prefix=prefix
        )
        return layout.num_tokens, documents

    # start from the sentences that fit by their own counts, then drop from the end until the
    # prompt fits, then add while it still fits: at most `length` tokens, short of it by less
    # than one sentence and a document header
    def size(k: int) -> int:
        return haystack[(start + k) % len(haystack)].tokens

    count, total = 0, 0
    while count < len(haystack) and total + size(count) <= length:
        total += size(count)
        count += 1
    tokens, documents = build(count) if count else (length + 1, [])
    while tokens > length and count > 1:
        over, drop = tokens - length, 0
        while count > 1 and drop < over:
            count -= 1
            drop += size(count)
        tokens, documents = build(count)
    if tokens > length:
        raise ValueError(f"cannot fit a needle prompt into {length} tokens")
    while count < len(haystack):
        grown = build(count + 1)
        if grown[0] > length:
            break
        count, (tokens, documents) = count + 1, grown
    holder = next(d for d in documents if needle_text in d.text)
    offset = holder.text.index(needle_text)
    return EvalItem(
        id="",
        question=question,
        documents=documents,
        type="needle",
        answers=[needle.value],
        gold_doc_ids=[holder.id],
        answer_prefix=prefix,
        metadata={
            "length": length,
            "depth": depth,
            "key": needle.key,
            "evidence_doc_id": holder.id,
            "evidence_span": [offset, offset + len(needle_text)],
            "value_span": [
                offset + needle_text.index(needle.value),
                offset + needle_text.index(needle.value) + len(needle.value),
            ],
        },
    )


def build_needles(
    haystack_dir: Path,
    tokenizer: Any,
    *,
    lengths: list[int],
    depths: list[float],
    samples: int = 1,
    seed: int = 0,
    needles_file: Path | None = None,
    answer_prefix: bool = True,
    chunk_tokens: int = 256,
) -> LoadedItems:
    """Items for every sample x depth x length (ids ``niah-L{length}-d{depth}-s{sample}``).

    An item depends only on its id and the seed, so adding samples, lengths or depths
    later leaves the existing items as they were.
    """
    if not lengths or not depths or samples < 1:
        raise InputError("needles need --lengths, --depths and --samples >= 1", field="lengths")
    for depth in depths:
        if not 0 <= depth <= 100:
            raise InputError(f"depths are percentages in [0, 100], got {depth}", field="depths")
    haystack = read_haystack(haystack_dir, tokenizer)
    given = load_needles(needles_file) if needles_file else None
    items: list[EvalItem] = []
    malformed: list[Malformed] = []
    # sample-major, so that --limit (or an interrupted run) covers every depth and length
    for sample in range(samples):
        for depth in depths:
            for length in lengths:
                item_id = f"niah-L{length}-d{depth:g}-s{sample}"
                rng = item_rng(seed, item_id)
                needle = given[rng.randrange(len(given))] if given else _random_needle(rng)
                start = rng.randrange(len(haystack))
                try:
                    item = _build_one(
                        haystack,
                        needle,
                        tokenizer,
                        length,
                        depth,
                        start,
                        chunk_tokens,
                        answer_prefix,
                    )
                except (InputError, KeyError, ValueError, StopIteration) as exc:
                    malformed.append(Malformed(item_id, f"cannot build: {exc}"))
                    continue
                item.id = item_id
                item.metadata["sample"] = sample
                items.append(item)
    return LoadedItems(items=items, malformed=malformed)
