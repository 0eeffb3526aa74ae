"""Unsupported-sentence detection against a hand-labelled set (issue 43).

Each JSONL row holds a ``question``, an answer ``sentence``, the ``quotes`` cited for it
and a ``label`` (``supported`` / ``unsupported``) given by reading them. The positive
class is ``unsupported``: precision is the share of sentences the checker flags that the
reader flagged, recall the share of the reader's flags the checker finds.

``python -m ragsnap.eval.claim_labels [PATH]`` prints one JSON object; with ``--lift``
it also loads the embedded model and reports how well the likelihood lift alone
(:mod:`ragsnap.citations.lift`: the sentence given its quotes against given none) ranks
the reader's unsupported sentences below the supported ones (AUC, and mean lifts).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ragsnap.citations.sentences import Sentence
from ragsnap.citations.support import SupportRule, check_sentence


@dataclass(frozen=True)
class LabelScore:
    """Counts and rates of the checker on a labelled set (positive: unsupported)."""

    n: int
    true_pos: int
    false_pos: int
    false_neg: int

    @property
    def precision(self) -> float:
        flagged = self.true_pos + self.false_pos
        return self.true_pos / flagged if flagged else 1.0

    @property
    def recall(self) -> float:
        wanted = self.true_pos + self.false_neg
        return self.true_pos / wanted if wanted else 1.0


def load_labels(path: Path) -> list[dict[str, object]]:
    """The rows of a labelled JSONL file."""
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def score_labels(rows: Iterable[dict[str, object]], rule: SupportRule | None = None) -> LabelScore:
    """The checker's unsupported-sentence precision and recall on ``rows``."""
    n = tp = fp = fn = 0
    for row in rows:
        text = str(row["sentence"])
        quotes = [str(q) for q in row["quotes"]]  # type: ignore[attr-defined]
        check = check_sentence(
            Sentence(text, 0, len(text)), quotes, quotes, str(row["question"]), rule
        )
        flagged = not check.supported
        wanted = row["label"] == "unsupported"
        n += 1
        tp += flagged and wanted
        fp += flagged and not wanted
        fn += wanted and not flagged
    return LabelScore(n, tp, fp, fn)


def lift_ranking(rows: list[dict[str, object]], threads: int = 1) -> dict[str, float]:
    """The lift of every labelled sentence on the embedded model: the share of
    (supported, unsupported) pairs the lift orders right (AUC, ties count half) and the
    mean lift of each label."""
    from ragsnap.engine.engine import RagSnapEngine

    engine = RagSnapEngine.load(
        "embedded", device="cpu", dtype="float32", cache_url="none", threads=threads
    )
    lifts: dict[bool, list[float]] = {True: [], False: []}
    for row in rows:
        quotes = [str(q) for q in row["quotes"]]  # type: ignore[attr-defined]
        lift = engine.citing.sentence_lift(str(row["question"]), quotes, str(row["sentence"]))
        lifts[row["label"] == "supported"].append(lift)
    good, bad = lifts[True], lifts[False]
    pairs = [(g > b) + 0.5 * (g == b) for g in good for b in bad]
    return {
        "auc": round(sum(pairs) / max(len(pairs), 1), 3),
        "mean_lift_supported": round(sum(good) / max(len(good), 1), 3),
        "mean_lift_unsupported": round(sum(bad) / max(len(bad), 1), 3),
    }


def main(argv: list[str] | None = None) -> None:
    default = Path(__file__).resolve().parents[2] / "tests" / "data" / "claim_support_labels.jsonl"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", type=Path, default=default)
    parser.add_argument("--lift", action="store_true", help="the likelihood lift's ranking too")
    args = parser.parse_args(argv)
    rows = load_labels(args.path)
    s = score_labels(rows)
    out: dict[str, object] = {
        "n": s.n,
        "precision": round(s.precision, 3),
        "recall": round(s.recall, 3),
    }
    out |= {"true_pos": s.true_pos, "false_pos": s.false_pos, "false_neg": s.false_neg}
    if args.lift:
        out["lift"] = lift_ranking(rows)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
