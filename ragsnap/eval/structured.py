"""Structured lookups: "what is the value of key K" over JSON, XML and Markdown-table inventories.

``structured`` items are generated: an inventory of records (key, a 7-digit value, a count,
a status), written as nested JSON, compact JSON, XML or a Markdown table, sized to a target
prompt length; the question asks for one record's value, which is the exact answer. The
character span of that value is recorded (``value_span``), so every run reports the share
of the asked value's tokens each press kept (``needle_kept_share``).

``kvretrieval`` items come from the JSON key-value data of "Lost in the Middle" (lines of
``{"ordered_kv_records": [[k, v], ...], "key", "value"}``, UUIDs), optionally cut to a
context size around the asked pair.
"""

from __future__ import annotations

import gzip
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ragsnap.errors import InputError
from ragsnap.eval.items import EvalItem, LoadedItems, Malformed
from ragsnap.eval.niah import _ADJECTIVES, _NOUNS, item_rng
from ragsnap.prompt.assembly import assemble_prompt
from ragsnap.prompt.documents import Document

STRUCTURES = ("nested-json", "compact-json", "xml", "table")
QUESTION = "What is the value of key {key}?"
ANSWER_PREFIX = "The value of key {key} is"
_STATUSES = ("active", "pending", "retired", "on-hold")
_FORMAT = {"nested-json": "json", "compact-json": "json", "xml": "xml", "table": "markdown"}

Record = dict[str, Any]


def _records(rng: random.Random, count: int) -> list[Record]:
    keys: set[str] = set()
    values: set[int] = set()
    records: list[Record] = []
    while len(records) < count:
        key = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}-{rng.randint(10, 99)}"
        value = rng.randint(1_000_000, 9_999_999)
        if key in keys or value in values:
            continue
        keys.add(key)
        values.add(value)
        records.append(
            {
                "key": key,
                "value": value,
                "count": rng.randint(1, 99),
                "status": rng.choice(_STATUSES),
            }
        )
    return records


def render(structure: str, records: list[Record]) -> str:
    """The inventory as text in ``structure`` (one of :data:`STRUCTURES`)."""
    if structure in ("nested-json", "compact-json"):
        body = {r["key"]: {k: v for k, v in r.items() if k != "key"} for r in records}
        if structure == "nested-json":
            return json.dumps({"inventory": body}, indent=2)
        return json.dumps({"inventory": body}, separators=(",", ":"))
    if structure == "xml":
        rows = [
            f'  <item key="{r["key"]}"><value>{r["value"]}</value><count>{r["count"]}</count>'
            f"<status>{r['status']}</status></item>"
            for r in records
        ]
        return "<inventory>\n" + "\n".join(rows) + "\n</inventory>"
    if structure == "table":
        rows = [f"| {r['key']} | {r['value']} | {r['count']} | {r['status']} |" for r in records]
        return "| key | value | count | status |\n|---|---|---|---|\n" + "\n".join(rows)
    raise InputError(
        f"unknown structure {structure!r} (choose from: {', '.join(STRUCTURES)})",
        field="structures",
    )


def _item(structure: str, records: list[Record], asked: int, use_prefix: bool) -> EvalItem:
    record = records[asked]
    text = render(structure, records)
    value = str(record["value"])
    offset = text.index(value)  # values are distinct 7-digit numbers, counts have 2 digits
    document = Document(id="inventory", title="Inventory", text=text, format=_FORMAT[structure])
    return EvalItem(
        id="",
        question=QUESTION.format(key=record["key"]),
        documents=[document],
        type="needle",
        answers=[value],
        gold_doc_ids=[document.id],
        answer_prefix=ANSWER_PREFIX.format(key=record["key"]) if use_prefix else "",
        metadata={
            "key": record["key"],
            "structure": structure,
            "records": len(records),
            "depth": round(100 * asked / max(len(records) - 1, 1)),
            "evidence_doc_id": document.id,
            "value_span": [offset, offset + len(value)],
        },
    )


def _fit(
    structure: str,
    pool: list[Record],
    rng: random.Random,
    tokenizer: Any,
    length: int,
    prefix: bool,
) -> EvalItem:
    """As many records of ``pool`` as fit a ``length``-token prompt, one of them asked."""
    fraction = rng.random()

    def build(n: int) -> tuple[int, EvalItem]:
        item = _item(structure, pool[:n], min(int(fraction * n), n - 1), prefix)
        layout = assemble_prompt(
            tokenizer,
            item.question,
            item.documents,
            max_prompt_tokens=10 * length,
            answer_prefix=item.answer_prefix,
        )
        return layout.num_tokens, item

    if build(1)[0] > length:
        raise ValueError(f"one record does not fit {length} tokens")
    low, high = 1, 2  # the largest n whose prompt fits: double until too long, then bisect
    while high < len(pool) and build(high)[0] <= length:
        low, high = high, min(2 * high, len(pool))
    while low < high:
        mid = (low + high + 1) // 2
        if build(mid)[0] <= length:
            low = mid
        else:
            high = mid - 1
    item = build(low)[1]
    item.metadata["length"] = length
    return item


def build_structured(
    tokenizer: Any,
    *,
    lengths: list[int],
    structures: list[str] | None = None,
    samples: int = 1,
    seed: int = 0,
    answer_prefix: bool = True,
) -> LoadedItems:
    """Items for every sample x structure x length (ids ``struct-{structure}-L{length}-s{sample}``);
    an item depends only on its id and the seed."""
    chosen = structures or list(STRUCTURES)
    unknown = sorted(set(chosen) - set(STRUCTURES))
    if unknown:
        raise InputError(
            f"unknown structures {', '.join(unknown)} (choose from: {', '.join(STRUCTURES)})",
            field="structures",
        )
    if not lengths or min(lengths) < 1 or samples < 1:
        raise InputError("structured lookups need --lengths and --samples >= 1", field="lengths")
    items: list[EvalItem] = []
    malformed: list[Malformed] = []
    for sample in range(samples):
        for structure in chosen:
            for length in lengths:
                item_id = f"struct-{structure}-L{length}-s{sample}"
                rng = item_rng(seed, item_id)
                pool = _records(rng, max(8, length))  # each record takes at least one token
                try:
                    item = _fit(structure, pool, rng, tokenizer, length, answer_prefix)
                except ValueError as exc:
                    malformed.append(Malformed(item_id, f"cannot build: {exc}"))
                    continue
                item.id = item_id
                item.metadata["sample"] = sample
                items.append(item)
    return LoadedItems(items=items, malformed=malformed)


# -- "Lost in the Middle" key-value retrieval -----------------------------------------


def _lines(path: Path) -> list[str]:
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rt", encoding="utf-8") as handle:
                return handle.read().splitlines()
        return path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError, EOFError) as exc:
        raise InputError(f"cannot read {path}: {exc}", field="data") from exc


def kv_retrieval_item(
    record: Any, item_id: str, context_tokens: int | None, count_tokens: Callable[[str], int] | None
) -> EvalItem:
    """One key-value retrieval prompt as a JSON-object document. With ``context_tokens``,
    pairs are dropped from the ends (never the asked one) until the text fits."""
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    pairs, key, value = record.get("ordered_kv_records"), record.get("key"), record.get("value")
    if not isinstance(key, str) or not isinstance(value, str) or not isinstance(pairs, list):
        raise ValueError("needs 'ordered_kv_records', 'key' and 'value'")
    try:
        kept = [(str(k), str(v)) for k, v in pairs]
    except (TypeError, ValueError) as exc:
        raise ValueError("'ordered_kv_records' must be [key, value] pairs") from exc
    if (key, value) not in kept:
        raise ValueError("the asked pair is not among the records")
    asked = kept.index((key, value))

    def text_of(window: list[tuple[str, str]]) -> str:
        return json.dumps(dict(window), indent=1)

    lo, hi = 0, len(kept)
    if context_tokens is not None and count_tokens is not None:
        tokens = count_tokens(text_of(kept))
        per_pair = tokens / len(kept)
        while tokens > context_tokens and hi - lo > 1:
            # drop about the excess at once (a few tokenizations per item, not one per pair),
            # each pair from the side farther from the asked one
            for _ in range(max(1, int((tokens - context_tokens) / per_pair))):
                if hi - lo <= 1:
                    break
                if asked - lo > hi - 1 - asked:
                    lo += 1
                else:
                    hi -= 1
            tokens = count_tokens(text_of(kept[lo:hi]))
    text = text_of(kept[lo:hi])
    offset = text.index(f'"{key}": "{value}"') + len(f'"{key}": "')
    return EvalItem(
        id=item_id,
        question=f'What is the value of key "{key}"?',
        documents=[Document(id="kv", title="JSON data", text=text, format="json")],
        type="short",
        answers=[value],
        gold_doc_ids=["kv"],
        answer_prefix=f'The value of key "{key}" is',
        metadata={
            "key": key,
            "records": hi - lo,
            "depth": round(100 * (asked - lo) / max(hi - lo - 1, 1)),
            "evidence_doc_id": "kv",
            "value_span": [offset, offset + len(value)],
        },
    )


def load_kv_retrieval(
    path: Path,
    *,
    context_tokens: int | None = None,
    count_tokens: Callable[[str], int] | None = None,
) -> LoadedItems:
    """Items ``kv-{line}`` from a ``.jsonl`` or ``.jsonl.gz`` file of key-value prompts."""
    items: list[EvalItem] = []
    malformed: list[Malformed] = []
    for lineno, line in enumerate(_lines(path), start=1):
        if not line.strip():
            continue
        where = f"{path.name}:{lineno}"
        try:
            items.append(
                kv_retrieval_item(json.loads(line), f"kv-{lineno}", context_tokens, count_tokens)
            )
        except json.JSONDecodeError as exc:
            malformed.append(Malformed(where, f"not valid JSON ({exc.msg})"))
        except ValueError as exc:
            malformed.append(Malformed(where, str(exc)))
    return LoadedItems(items=items, malformed=malformed)
