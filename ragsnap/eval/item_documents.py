"""Every document of the items ``ragsnap.eval.grounding_eval`` asked about, answerable and
unanswerable (gold documents removed and padded back as it does), keyed by the rows' ids.

Rows record only the documents an answer cites; a check that reads the others (the link
between the answer's documents and the question's subject, issue 53 session 29:
:func:`ragsnap.citations.relevance.unlinked`) is replayed on rows recorded before it from
this file (``ragsnap.eval.consistency_calibrate --documents``).

``python -m ragsnap.eval.item_documents --format hotpotqa --data PATH -n 50 --skip 50
--out DOCS.json`` (the same arguments as the run that wrote the rows; loads the embedded
model's tokenizer, which counts the padding).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from ragsnap.eval.grounding_eval import item_pairs
from ragsnap.eval.items import EvalItem


def entry(item: EvalItem) -> dict:
    return {
        "question": item.question,
        "answers": list(item.answers),
        "docs": [{"id": d.id, "title": d.title, "text": d.text} for d in item.documents],
    }


def main(argv: Sequence[str] | None = None) -> int:
    from ragsnap.engine.engine import RagSnapEngine

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", choices=("hotpotqa", "bioasq"), required=True)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("-n", type=int, default=50)
    parser.add_argument("--skip", type=int, default=0)
    parser.add_argument("--context-tokens", type=int, default=2000)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    engine = RagSnapEngine.load("embedded", device="cpu", dtype="float32", cache_url="none")

    items, missing = item_pairs(engine, args)
    out = {i.id: entry(i) for i in items + missing}
    args.out.write_text(json.dumps(out), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
