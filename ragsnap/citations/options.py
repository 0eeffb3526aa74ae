"""How an answer gets its citations (part of every request's options)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ragsnap.citations.attribution import AttributionWeights
from ragsnap.errors import ConfigError

CITATION_MODES = ("attribution", "markers")


@dataclass(frozen=True)
class CitationOptions:
    """``mode``: ``attribution`` (evidence from overlap and the answer's attention; the
    model's markers are checked against it) or ``markers`` (model-written markers only, no
    evidence). ``marker_control`` lets only given document numbers follow ``[`` while
    decoding. ``inline_markers`` adds ``[n]`` after each supported sentence in
    ``answer_with_markers`` (the streamed tokens are never changed). ``attention_layers``
    are the layers whose attention is recomputed (None: the calibrated default)."""

    mode: str = "attribution"
    marker_control: bool = True
    inline_markers: bool = False
    weights: AttributionWeights = field(default_factory=AttributionWeights)
    attention_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.mode not in CITATION_MODES:
            raise ConfigError(
                f"citations must be one of {', '.join(CITATION_MODES)}, got {self.mode!r}",
                field="citations",
            )
