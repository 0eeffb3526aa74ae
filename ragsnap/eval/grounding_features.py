"""Measure a grounded rule's features again on recorded rows (issue 43), without answering.

``grounding_eval --rows FILE`` keeps, per row, the question, the model's answer, its
checked citations and the cited documents (``raw_material``); this recomputes every
feature of :func:`ragsnap.eval.grounding_eval.answer_features` from them on the embedded
model (one short pass per answer), so a new feature can be calibrated on rows already
recorded. ``python -m ragsnap.eval.grounding_features ROWS.json [...]`` rewrites each file
in place (``--out-suffix`` writes a sibling instead); ``--lexical`` measures only the
features read from words (:func:`ragsnap.eval.grounding_eval.kind_features`), without
loading the model.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ragsnap.citations.model import Citation, Quote, Span
from ragsnap.prompt.documents import Document


def citation_from_dict(data: dict[str, Any]) -> Citation:
    """The :class:`Citation` that ``Citation.to_dict`` wrote."""
    return Citation(
        **{
            **data,
            "sentences": tuple(data["sentences"]),
            "quotes": tuple(Quote(**q) for q in data["quotes"]),
            "spans": tuple(tuple(s) for s in data["spans"]),
            "unsupported": tuple(Span(**u) for u in data["unsupported"]),
        }
    )


def recorded_documents(row: dict[str, Any]) -> list[Document]:
    """The cited documents of ``row`` in the prompt's order (uncited entries empty)."""
    docs: dict[str, dict[str, str]] = row.get("documents", {})
    size = max((int(i) for i in docs), default=0)
    out = [Document(id="", text="", title="") for _ in range(size)]
    for index, doc in docs.items():
        out[int(index) - 1] = Document(id=index, text=doc["text"], title=doc["title"])
    return out


def refeature(engine: Any, row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with every feature measured again from its raw material."""
    from ragsnap.eval.grounding_eval import answer_features

    citations = [citation_from_dict(c) for c in row["citations"]]
    cited = recorded_documents(row)
    features = answer_features(engine, row["question"], row["model_answer"], citations, cited)
    # the uncited documents are not recorded: what the documents name stays as measured
    kept: dict[str, Any] = {k: row[k] for k in ("not_in_documents", "named") if k in row}
    return {**row, **features, **kept}


def relexical(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with its lexical answer-kind features measured again (no model)."""
    from ragsnap.eval.grounding_eval import kind_features

    citations = [citation_from_dict(c) for c in row["citations"]]
    return {**row, **kind_features(row["question"], row["model_answer"], citations)}


def main(argv: Sequence[str] | None = None) -> int:
    from ragsnap.engine.engine import RagSnapEngine

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rows", nargs="+", type=Path)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out-suffix", default="", help="write FILE<suffix>.json instead")
    parser.add_argument("--lexical", action="store_true", help="only the word features")
    args = parser.parse_args(argv)
    if args.lexical:
        measure = relexical
    else:
        engine = RagSnapEngine.load(
            "embedded", device="cpu", dtype="float32", cache_url="none", threads=args.threads
        )
        measure = lambda row: refeature(engine, row)  # noqa: E731
    for path in args.rows:
        data = json.loads(path.read_text(encoding="utf-8"))
        out = {name: [measure(r) for r in rows] for name, rows in data.items()}
        target = path.with_name(path.stem + args.out_suffix + path.suffix)
        target.write_text(json.dumps(out), encoding="utf-8")
        print(f"{target}: {sum(len(r) for r in out.values())} rows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
