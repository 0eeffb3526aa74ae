"""Query-aware prefill (token-selective propagation): which tokens go past layer ``s``.

:class:`PropagatePress` wraps any window-voting press. Its prefill runs layers ``0 .. s-1``
over the whole prompt; at layer ``s - 1`` (the ``s``-th layer) the observation window's
queries vote with the base press's SnapKV scores (pooled, per KV head), and only a share
``p`` of the prompt (at least what the budget needs; always the window, the system
instruction and the document headers) runs through layers ``s .. L-1``, each token at its
original position (:mod:`ragsnap.runtime.propagation`). The press itself compresses as its
base does: early layers from their full KV, later ones from the propagated tokens.

``s`` and ``p`` are part of the press config, hence of every exact-hit cache key: entries
made on the two paths never mix. ``layer="auto"`` / ``share="auto"`` read the calibrated
values packaged for the model (``ragsnap/compression/profiles/propagation/``, written by
``ragsnap calibrate-propagation``), with :data:`FALLBACK_LAYER_SHARE` and
:data:`FALLBACK_SHARE` for a model without one.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from ragsnap.compression.base import (
    DEFAULT_KERNEL,
    DEFAULT_WINDOW,
    CompressedLayer,
    LayerContext,
    Press,
    WrapperPress,
)
from ragsnap.errors import ConfigError

# without a calibrated entry: s = round(0.4 L) (clamped to 1..L-1), p = 0.3
FALLBACK_LAYER_SHARE = 0.4
FALLBACK_SHARE = 0.3


@dataclass(frozen=True)
class Propagation:
    """Resolved settings for one model: run layers ``[0, layer)`` over every token and
    layers ``[layer, num_layers)`` over ``share`` of them."""

    layer: int
    share: float

    def check(self, num_layers: int) -> None:
        """Raise :class:`ConfigError` naming the field when a value is out of range."""
        if not 1 <= self.layer <= num_layers - 1:
            raise ConfigError(
                f"propagate_layer must be between 1 and {num_layers - 1} for this model "
                f"({num_layers} layers), got {self.layer}",
                field="propagate_layer",
            )
        check_share(self.share)


def check_share(share: float) -> None:
    if not (isinstance(share, (int, float)) and 0.0 < float(share) <= 1.0):
        raise ConfigError(
            f"propagate_share must be in (0, 1], got {share!r}", field="propagate_share"
        )


@dataclass
class PropagatePress(WrapperPress):
    """Wrap a press: its prefill propagates only the window's chosen tokens past ``layer``.

    ``layer`` is ``s`` (1 .. L-1, checked against the model at prefill) or ``"auto"``;
    ``share`` is ``p`` in (0, 1] or ``"auto"``. Compression is ``base``'s. Around a
    press that needs every prompt query (H2O) the prefill takes the full path and says so
    (``PrefillResult.full_path_reason``).
    """

    name = "propagate"
    base: Press
    layer: int | str = "auto"
    share: float | str = "auto"

    def __post_init__(self) -> None:
        if self.layer != "auto" and (
            isinstance(self.layer, bool) or not isinstance(self.layer, int)
        ):
            raise ConfigError(
                f"propagate_layer must be an integer or 'auto', got {self.layer!r}",
                field="propagate_layer",
            )
        if isinstance(self.layer, int) and self.layer < 1:
            raise ConfigError(
                f"propagate_layer must be at least 1, got {self.layer}", field="propagate_layer"
            )
        if self.share != "auto":
            check_share(self.share)  # type: ignore[arg-type]

    def config(self) -> dict[str, Any]:
        path: dict[str, Any] = {"layer": self.layer, "share": self.share}
        if "auto" in (self.layer, self.share):  # entries follow the packaged calibration
            path["calibration"] = _calibration_digest()
        return {**self.base.config(), "propagate": path}

    def compress(self, layer: LayerContext) -> CompressedLayer:
        return self.base.compress(layer)

    def resolve(self, model_config: Any) -> Propagation:
        """``s`` and ``p`` for a model (``"auto"`` from its calibration), checked."""
        text = getattr(model_config, "get_text_config", lambda: model_config)()
        num_layers = int(text.num_hidden_layers)
        calibrated = packaged_propagation(_fingerprint(text))
        layer = self.layer
        if layer == "auto":
            layer = calibrated[0] if calibrated else round(FALLBACK_LAYER_SHARE * num_layers)
            layer = min(max(int(layer), 1), max(num_layers - 1, 1))
        share = self.share
        if share == "auto":
            share = calibrated[1] if calibrated else FALLBACK_SHARE
        resolved = Propagation(int(layer), float(share))
        resolved.check(num_layers)
        return resolved


def propagation_of(press: Press) -> PropagatePress | None:
    """The :class:`PropagatePress` in ``press``'s chain of wrappers, if any."""
    current: Any = press
    while current is not None:
        if isinstance(current, PropagatePress):
            return current
        current = getattr(current, "base", None)
    return None


def without_propagation(press: Press) -> Press:
    """``press`` with its :class:`PropagatePress` removed (the full path), else ``press``."""
    import dataclasses

    if isinstance(press, PropagatePress):
        return press.base
    base = getattr(press, "base", None)
    if base is None or propagation_of(base) is None:
        return press
    return dataclasses.replace(press, base=without_propagation(base))  # type: ignore[call-arg,type-var]


def voting_parameters(press: Press) -> tuple[int, int, str]:
    """``(window, kernel, pooling)`` of the SnapKV scores in ``press``'s chain (SnapKV's
    defaults, :data:`DEFAULT_WINDOW` / :data:`DEFAULT_KERNEL` / max, where a press has none)."""
    current: Any = press
    while current is not None:
        if hasattr(current, "kernel") and hasattr(current, "pooling"):
            return int(current.window), int(current.kernel), str(current.pooling)
        current = getattr(current, "base", None)
    return int(getattr(press, "window", DEFAULT_WINDOW) or DEFAULT_WINDOW), DEFAULT_KERNEL, "max"


def budget_need(press: Press, length: int) -> int:
    """The fewest tokens that may propagate for a ``length``-token prompt: the budget per
    KV head of ``press``'s scorer (``ratio * length`` for a ratio), 0 for a press without
    one. A profiled layer whose own budget is larger keeps every propagated token
    (:func:`~ragsnap.compression.layer_budgets.split_budget` caps it at what the layer
    holds and gives the rest to the other layers)."""
    from ragsnap.compression.base import ScorerPress

    current: Any = press
    while current is not None and not isinstance(current, ScorerPress):
        current = getattr(current, "base", None)
    if current is None:
        return 0
    if current.budget is not None:
        return int(current.budget)
    return max(int(current.window), math.ceil((current.ratio or 0.0) * length))


def _fingerprint(text_config: Any) -> str:
    from ragsnap.compression.layer_budgets import model_fingerprint

    return model_fingerprint(text_config)


def _propagation_dir() -> Any:
    return resources.files("ragsnap.compression").joinpath("profiles").joinpath("propagation")


@cache
def _calibration_digest() -> str:
    directory = _propagation_dir()
    files = sorted(
        (entry.name, entry.read_bytes())
        for entry in (directory.iterdir() if directory.is_dir() else [])
        if entry.name.endswith(".json")
    )
    return hashlib.sha256(repr(files).encode()).hexdigest()[:16]


@cache
def packaged_propagation(fingerprint: str) -> tuple[int, float] | None:
    """The calibrated ``(s, p)`` shipped for ``fingerprint``, or None."""
    entry = _propagation_dir().joinpath(f"{fingerprint}.json")
    if not entry.is_file():
        return None
    data = json.loads(entry.read_text())
    return int(data["layer"]), float(data["share"])
