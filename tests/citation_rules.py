"""Attribution rules for tests: overlap evidence only, and none of the calibrated extras
(no relative gap, one BM25 anchor at most, 3 documents per answer) unless a test asks."""

from __future__ import annotations

from typing import Any

from ragsnap.citations.attribution import AttributionWeights

PLAIN = {"ratio": 0.0, "anchor_ratio": None, "named_anchors": False, "max_documents": 3}


def overlap_rule(**rule: Any) -> AttributionWeights:
    return AttributionWeights(overlap=1.0, attention=0.0, question=0.0, **{**PLAIN, **rule})
