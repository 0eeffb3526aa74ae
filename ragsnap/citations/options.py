"""How an answer gets its citations (part of every request's options)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ragsnap.citations.attribution import AttributionWeights
from ragsnap.citations.support import SupportRule
from ragsnap.errors import ConfigError

CITATION_MODES = ("attribution", "markers")
UNSUPPORTED_MODES = ("flag", "abstain")
ABSTAIN_TEXT = "The documents do not answer this."


@dataclass(frozen=True)
class CitationOptions:
    """``mode``: ``attribution`` (evidence from overlap and the answer's attention; the
    model's markers are checked against it) or ``markers`` (model-written markers only, no
    evidence). ``marker_control`` lets only given document numbers follow ``[`` while
    decoding. ``inline_markers`` adds ``[n]`` after each supported sentence in
    ``answer_with_markers`` (the streamed tokens are never changed). ``attention_layers``
    are the layers whose attention is recomputed (None: the calibrated default).

    ``unsupported``: what becomes of an answer that is not grounded (issue 43): ``flag``
    (the verdict only) or ``abstain`` (the final answer is ``abstain_text``, the model's
    own kept as ``model_answer``; the streamed tokens are never changed); ``support`` the
    claim-level rule (:mod:`ragsnap.citations.support`)."""

    mode: str = "attribution"
    marker_control: bool = True
    inline_markers: bool = False
    weights: AttributionWeights = field(default_factory=AttributionWeights)
    attention_layers: tuple[int, ...] | None = None
    unsupported: str = "flag"
    abstain_text: str = ABSTAIN_TEXT
    support: SupportRule = field(default_factory=SupportRule)

    def __post_init__(self) -> None:
        if self.unsupported not in UNSUPPORTED_MODES:
            raise ConfigError(
                f"unsupported must be one of {', '.join(UNSUPPORTED_MODES)}, "
                f"got {self.unsupported!r}",
                field="unsupported",
            )
        if self.mode not in CITATION_MODES:
            raise ConfigError(
                f"citations must be one of {', '.join(CITATION_MODES)}, got {self.mode!r}",
                field="citations",
            )
