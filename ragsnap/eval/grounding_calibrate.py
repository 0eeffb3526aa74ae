"""Calibrate the likelihood rule of the grounded verdict (issue 43) on held-out rows.

Reads the rows ``ragsnap.eval.grounding_eval --skip 50 --rows FILE`` writes (items the
evaluation does not use) and fits :class:`ragsnap.citations.lift.LiftRule`: a logistic
rule over the lexical share, whether the key sentence is supported and its clipped
likelihood lift. Positives are right answers to answerable items (they should be
grounded), negatives answers to unanswerable items (they should not); answerable items
answered wrong are left out (containment cannot tell a wrong answer from a paraphrase).
The classes are weighted equally; the bias is then the one that maximizes the share of
positives grounded plus the share of negatives not grounded (Youden's J), among those
that keep at least ``--right-grounded`` of the positives grounded.

``python -m ragsnap.eval.grounding_calibrate ROWS.json [ROWS.json ...] [--out PROFILE]``
prints the fitted rule and each candidate's rates on the rows; ``--out`` writes the
profile (``ragsnap/citations/profiles/<fingerprint>.json``).
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


def labelled(rows_files: Sequence[Path]) -> list[tuple[SupportFeatures, int]]:
    """(features, 1 for a right answerable answer / 0 for an unanswerable one) per row
    that has a lexical score (an answer that asserts nothing has no verdict)."""
    out = []
    for path in rows_files:
        data = json.loads(path.read_text(encoding="utf-8"))
        sets = [(r, 1) for r in data["answerable"] if r["correct"]]
        sets += [(r, 0) for r in data["unanswerable"]]
        for row, label in sets:
            if row["lexical_score"] is None:
                continue
            key = 1.0 if row["key_supported"] else 0.0
            out.append((SupportFeatures(row["lexical_score"], key, row["lift"]), label))
    return out


def rates(rule: LiftRule, data: Sequence[tuple[SupportFeatures, int]]) -> dict[str, float]:
    """The share of positives grounded and of negatives not grounded under ``rule``."""
    pos = [rule.probability(f) >= 0.5 for f, y in data if y == 1]
    neg = [rule.probability(f) < 0.5 for f, y in data if y == 0]
    return {
        "right_grounded": round(sum(pos) / max(len(pos), 1), 4),
        "unanswerable_not_grounded": round(sum(neg) / max(len(neg), 1), 4),
    }


def fit(
    data: Sequence[tuple[SupportFeatures, int]],
    clip: float,
    right_grounded: float,
    use_lift: bool = True,
    steps: int = 3000,
    l2: float = 0.01,
) -> LiftRule:
    """A class-balanced logistic fit (L2 ``l2``) of the three weights, then the bias of
    :func:`best_bias`."""
    lift = lambda f: max(-clip, min(clip, -clip if f.lift is None else f.lift))  # noqa: E731
    x = torch.tensor(
        [[f.share, f.key_supported, lift(f) if use_lift else 0.0] for f, _ in data],
        dtype=torch.float64,
    )
    y = torch.tensor([float(lab) for _, lab in data], dtype=torch.float64)
    weight = torch.where(y > 0, 0.5 / y.sum().clamp(min=1), 0.5 / (1 - y).sum().clamp(min=1))
    w = torch.zeros(3, dtype=torch.float64, requires_grad=True)
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
    weights = w.detach().tolist()
    lift_w = weights[2] if use_lift else 0.0
    base = LiftRule(weights[0], weights[1], lift_w, 0.0, clip)
    z = [base.logit(f) for f, _ in data]
    return LiftRule(base.lexical, base.answer, lift_w, best_bias(z, data, right_grounded), clip)


def best_bias(
    z: Sequence[float], data: Sequence[tuple[SupportFeatures, int]], right_grounded: float
) -> float:
    """The bias (a row is grounded when ``z + bias >= 0``) with the most positives grounded
    plus negatives not grounded (Youden's J) among those that keep at least
    ``right_grounded`` of the positives grounded (all biases when none does)."""
    scored = [(zi, y) for zi, (_, y) in zip(z, data, strict=True)]
    pos = max(sum(y for _, y in data), 1)
    neg = max(sum(1 - y for _, y in data), 1)
    candidates = []
    for cut in sorted({zi for zi, _ in scored}) + [math.inf]:
        tp = sum(1 for zi, y in scored if y == 1 and zi >= cut)
        tn = neg - sum(1 for zi, y in scored if y == 0 and zi >= cut)
        candidates.append((tp / pos, tn / neg, cut))
    floor = [c for c in candidates if c[0] >= right_grounded] or candidates
    tpr, tnr, cut = max(floor, key=lambda c: (c[0] + c[1], c[0]))
    if math.isinf(cut):
        return -1e6
    # halfway to the next lower score, so a small shift does not flip the row at the cut
    below = max((zi for zi, _ in scored if zi < cut), default=cut - 1.0)
    return -(cut + below) / 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rows", nargs="+", type=Path)
    parser.add_argument("--clip", type=float, default=1.0, help="lift clip, nats per token")
    parser.add_argument(
        "--right-grounded", type=float, default=0.0, help="floor on right answers grounded"
    )
    parser.add_argument("--out", type=Path, help="write the profile JSON here")
    parser.add_argument("--model", default="", help="fingerprint recorded in the profile")
    args = parser.parse_args(argv)
    data = labelled(args.rows)
    lexical = LiftRule(lexical=100.0, answer=0.0, lift=0.0, bias=-50.0)  # share >= 0.5 alone
    no_lift = fit(data, args.clip, args.right_grounded, use_lift=False)
    rule = fit(data, args.clip, args.right_grounded)
    report: dict[str, Any] = {
        "n_positive": sum(y for _, y in data),
        "n_negative": sum(1 - y for _, y in data),
        "lexical_share_rule": rates(lexical, data),
        "without_lift": {"rule": vars(no_lift), **rates(no_lift, data)},
        "with_lift": {"rule": vars(rule), **rates(rule, data)},
    }
    print(json.dumps(report, indent=2))
    if args.out:
        profile = {
            "model": args.model,
            "rule": {k: round(v, 6) for k, v in vars(rule).items()},
            "calibrated_on": [str(p.name) for p in args.rows],
            "held_out": report,
        }
        args.out.write_text(json.dumps(profile, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
