"""Calibrate the likelihood rule of the grounded verdict (issue 43) on held-out rows.

Reads the rows ``ragsnap.eval.grounding_eval --skip 50 --rows FILE`` writes (items the
evaluation does not use) and fits :class:`ragsnap.citations.lift.LiftRule`: a logistic
rule over the lexical share, whether the key sentence is supported, its clipped
likelihood lift and, per variant (:data:`VARIANTS`), the question's coverage by the
cited documents (``--coverage-field`` names the row's variant), the question's lift and
whether the answer supplies the kind of thing asked (``kind``, ``--kind-field``), with or
without the rescue limited to plain words (``plain_only``), the lowest lifts for an
answer of the wrong kind (``kind_lowers_lift``) and the named gate (``named_gate``: an
answer to a question naming what no document mentions is not grounded; the weights are
fitted on the other rows, the bias on all). Positives are right
answers to answerable items (they should be grounded), negatives answers to unanswerable
items (they should not); answerable items answered wrong are left out (containment
cannot tell a wrong answer from a paraphrase). The classes are weighted equally; the
bias is then the one that meets both floors (``--right-grounded``, ``--unanswerable``)
with the widest margin, or when none does the best Youden's J among those that keep
``--right-grounded`` of the positives grounded. It also prints how well each feature
alone separates the two (AUC).

``python -m ragsnap.eval.grounding_calibrate ROWS.json [ROWS.json ...] [--ship VARIANT]
[--out PROFILE]`` prints every variant's rule and rates on the rows; ``--out`` writes the
``--ship`` variant's profile (``ragsnap/citations/profiles/<fingerprint>.json``).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ragsnap.citations.lift import LiftRule, SupportFeatures


def labelled(
    rows_files: Sequence[Path], coverage_field: str = "coverage", kind_field: str = "kind"
) -> list[tuple[SupportFeatures, int]]:
    """(features, 1 for a right answerable answer / 0 for an unanswerable one) per row
    that has a lexical score (an answer that asserts nothing has no verdict). Rows
    recorded before a feature existed read it as neutral (plain, full coverage, no
    question lift, the kind asked, every name in the documents); ``coverage_field`` and
    ``kind_field`` name the variants to read (a None kind reads as the kind asked)."""
    out = []
    for path in rows_files:
        data = json.loads(path.read_text(encoding="utf-8"))
        sets = [(r, 1) for r in data["answerable"] if r["correct"]]
        sets += [(r, 0) for r in data["unanswerable"]]
        for row, label in sets:
            if row["lexical_score"] is None:
                continue
            features = SupportFeatures(
                row["lexical_score"],
                1.0 if row["key_supported"] else 0.0,
                row["lift"],
                1.0 if row.get("plain", True) else 0.0,
                float(row.get(coverage_field, 1.0)),
                row.get("question_lift"),
                1.0 if row.get(kind_field, 1.0) in (None, True) else float(row[kind_field]),
                float(row.get("named", 1.0)),
            )
            out.append((features, label))
    return out


def auc(data: Sequence[tuple[SupportFeatures, int]], value: Any) -> float:
    """The share of (positive, negative) pairs ``value`` orders positive-first (ties
    count half): how well one feature separates right answers from unanswerable ones."""
    pos = [value(f) for f, y in data if y == 1]
    neg = [value(f) for f, y in data if y == 0]
    if not pos or not neg:
        return math.nan
    won = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return round(won / (len(pos) * len(neg)), 4)


def rates(rule: LiftRule, data: Sequence[tuple[SupportFeatures, int]]) -> dict[str, float]:
    """The share of positives grounded and of negatives not grounded under ``rule``."""
    pos = [rule.probability(f) >= 0.5 for f, y in data if y == 1]
    neg = [rule.probability(f) < 0.5 for f, y in data if y == 0]
    return {
        "right_grounded": round(sum(pos) / max(len(pos), 1), 4),
        "unanswerable_not_grounded": round(sum(neg) / max(len(neg), 1), 4),
    }


FEATURES = ("lexical", "answer", "lift", "coverage", "question", "kind")


def fit(
    data: Sequence[tuple[SupportFeatures, int]],
    clip: float,
    right_grounded: float,
    use: Sequence[str] = ("lexical", "answer", "lift"),
    plain_only: bool = False,
    steps: int = 3000,
    l2: float = 0.01,
    unanswerable: float = 0.0,
    kind_lowers_lift: bool = False,
    named_gate: bool = False,
) -> LiftRule:
    """A class-balanced logistic fit (L2 ``l2``) of the weights of the features in
    ``use`` (of :data:`FEATURES`; the others weigh 0), then the bias of
    :func:`best_bias`. With ``plain_only`` the key sentence's lift counts at most 0
    when a number, date or name in it is missing from its quotes; with
    ``kind_lowers_lift`` both lifts count as the lowest when the answer does not supply
    the kind of thing asked; with ``named_gate`` the rows the gate refuses (``named``
    0.0) are left out of the fit and count as not grounded when the bias is chosen."""

    def row(f: SupportFeatures) -> list[float]:
        shape = LiftRule(1.0, 1.0, 1.0, 0.0, clip, 1.0, 1.0, plain_only, 1.0, kind_lowers_lift)
        lift = shape._clipped(f.lift)
        if plain_only and not f.plain:
            lift = min(lift, 0.0)
        question = shape._clipped(f.question_lift)
        if kind_lowers_lift and not f.kind:
            lift = question = -clip
        values = {
            "lexical": f.share,
            "answer": f.key_supported,
            "lift": lift,
            "coverage": f.coverage,
            "question": question,
            "kind": f.kind,
        }
        return [values[name] if name in use else 0.0 for name in FEATURES]

    fitted = [(f, lab) for f, lab in data if not (named_gate and f.named < 1.0)] or data
    x = torch.tensor([row(f) for f, _ in fitted], dtype=torch.float64)
    y = torch.tensor([float(lab) for _, lab in fitted], dtype=torch.float64)
    weight = torch.where(y > 0, 0.5 / y.sum().clamp(min=1), 0.5 / (1 - y).sum().clamp(min=1))
    w = torch.zeros(len(FEATURES), dtype=torch.float64, requires_grad=True)
    b = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=steps, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        z = x @ w + b
        loss = (weight * torch.nn.functional.softplus(-(2 * y - 1) * z)).sum()
        loss = loss + l2 * (w**2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    got = dict(zip(FEATURES, w.detach().tolist(), strict=True))
    weights = {name: (got[name] if name in use else 0.0) for name in FEATURES}
    base = LiftRule(
        weights["lexical"],
        weights["answer"],
        weights["lift"],
        0.0,
        clip,
        weights["coverage"],
        weights["question"],
        plain_only,
        weights["kind"],
        kind_lowers_lift,
        named_gate,
    )
    z = [None if base.gated(f.named) else base.logit(f) for f, _ in data]
    bias = best_bias(z, data, right_grounded, unanswerable)
    return LiftRule(**{**vars(base), "bias": bias})


def best_bias(
    z: Sequence[float | None],
    data: Sequence[tuple[SupportFeatures, int]],
    right_grounded: float,
    unanswerable: float = 0.0,
) -> float:
    """The bias (a row is grounded when ``z + bias >= 0``) for both floors: among the
    cuts that keep at least ``right_grounded`` of the positives grounded and
    ``unanswerable`` of the negatives not grounded, the one with the largest smaller
    margin over its floor; when none meets both, the most positives grounded plus
    negatives not grounded (Youden's J) among those that keep ``right_grounded`` (all
    cuts when none does). A None score is a row no bias grounds (the named gate's)."""
    scored = [(zi, y) for zi, (_, y) in zip(z, data, strict=True) if zi is not None]
    pos = max(sum(y for _, y in data), 1)
    neg = max(sum(1 - y for _, y in data), 1)
    candidates = []
    for cut in sorted({zi for zi, _ in scored}) + [math.inf]:
        tp = sum(1 for zi, y in scored if y == 1 and zi >= cut)
        tn = neg - sum(1 for zi, y in scored if y == 0 and zi >= cut)
        candidates.append((tp / pos, tn / neg, cut))
    both = [c for c in candidates if c[0] >= right_grounded and c[1] >= unanswerable]
    if both and (right_grounded > 0 or unanswerable > 0):
        tpr, tnr, cut = max(
            both, key=lambda c: (min(c[0] - right_grounded, c[1] - unanswerable), c[0])
        )
    else:
        floor = [c for c in candidates if c[0] >= right_grounded] or candidates
        tpr, tnr, cut = max(floor, key=lambda c: (c[0] + c[1], c[0]))
    if math.isinf(cut):
        return -1e6
    # halfway to the next lower score, so a small shift does not flip the row at the cut
    below = max((zi for zi, _ in scored if zi < cut), default=cut - 1.0)
    return -(cut + below) / 2


_COVERED = ("lexical", "answer", "lift", "coverage")
# name: (features used, plain_only, kind_lowers_lift, named_gate)
VARIANTS: dict[str, tuple[tuple[str, ...], bool, bool, bool]] = {
    "without_lift": (("lexical", "answer"), False, False, False),
    "with_lift": (("lexical", "answer", "lift"), False, False, False),
    "plain_rescue": (("lexical", "answer", "lift"), True, False, False),
    "plain_rescue_coverage": (_COVERED, True, False, False),
    "plain_rescue_question": (("lexical", "answer", "lift", "question"), True, False, False),
    "plain_rescue_both": ((*_COVERED, "question"), True, False, False),
    "plain_rescue_coverage_kind": ((*_COVERED, "kind"), True, False, False),
    "plain_rescue_coverage_kind_lowest": ((*_COVERED, "kind"), True, True, False),
    "plain_rescue_coverage_lowest": (_COVERED, True, True, False),
    "plain_rescue_both_kind_lowest": ((*_COVERED, "question", "kind"), True, True, False),
    "plain_rescue_coverage_named": (_COVERED, True, False, True),
    "plain_rescue_coverage_kind_named": ((*_COVERED, "kind"), True, False, True),
    "plain_rescue_coverage_kind_lowest_named": ((*_COVERED, "kind"), True, True, True),
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rows", nargs="+", type=Path)
    parser.add_argument("--clip", type=float, default=1.0, help="lift clip, nats per token")
    parser.add_argument(
        "--right-grounded", type=float, default=0.0, help="floor on right answers grounded"
    )
    parser.add_argument(
        "--unanswerable", type=float, default=0.0, help="floor on unanswerable not grounded"
    )
    parser.add_argument("--coverage-field", default="coverage", help="the coverage variant")
    parser.add_argument("--kind-field", default="kind", help="the answer-kind variant")
    parser.add_argument("--ship", default="with_lift", choices=sorted(VARIANTS))
    parser.add_argument("--out", type=Path, help="write the profile JSON here")
    parser.add_argument("--model", default="", help="fingerprint recorded in the profile")
    args = parser.parse_args(argv)
    data = labelled(args.rows, args.coverage_field, args.kind_field)
    lexical = LiftRule(lexical=100.0, answer=0.0, lift=0.0, bias=-50.0)  # share >= 0.5 alone
    separation = {
        "share": auc(data, lambda f: f.share),
        "key_supported": auc(data, lambda f: f.key_supported),
        "lift": auc(data, lambda f: -9.0 if f.lift is None else f.lift),
        "plain": auc(data, lambda f: f.plain),
        "coverage": auc(data, lambda f: f.coverage),
        "question_lift": auc(data, lambda f: -9.0 if f.question_lift is None else f.question_lift),
        "kind": auc(data, lambda f: f.kind),
        "named": auc(data, lambda f: f.named),
    }
    report: dict[str, Any] = {
        "n_positive": sum(y for _, y in data),
        "n_negative": sum(1 - y for _, y in data),
        "auc": separation,
        "lexical_share_rule": rates(lexical, data),
    }
    rules = {}
    for name, (use, plain_only, lowest, gate) in VARIANTS.items():
        rules[name] = fit(
            data,
            args.clip,
            args.right_grounded,
            use,
            plain_only,
            unanswerable=args.unanswerable,
            kind_lowers_lift=lowest,
            named_gate=gate,
        )
        report[name] = {"rule": vars(rules[name]), **rates(rules[name], data)}
    print(json.dumps(report, indent=2))
    if args.out:
        profile = {
            "model": args.model,
            "rule": {
                k: (round(v, 6) if isinstance(v, float) else v)
                for k, v in vars(rules[args.ship]).items()
            },
            "calibrated_on": [str(p.name) for p in args.rows],
            "held_out": report,
        }
        args.out.write_text(json.dumps(profile, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
