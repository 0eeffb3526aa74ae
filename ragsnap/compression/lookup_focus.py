"""Lookup focus: the record a question names is kept first, whatever the press.

On structured documents a small model's question attention barely singles out the record
it asks about ("what is the value of key K"), so at a 5% budget the asked value is lost
among all the others. :mod:`ragsnap.prompt.focus` finds that record lexically (the question's
words against the document's parsed keys, attribute values and cells) and tags its tokens
with tiers (``LayerContext.focus``); this wrapper makes the wrapped press rank them first.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ragsnap.compression.base import CompressedLayer, LayerContext, Press, WrapperPress
from ragsnap.errors import ConfigError


@dataclass
class LookupFocusPress(WrapperPress):
    """Wrap any press: positions of the named record rank first, tier by tier, inside the
    same budget.

    The tiers travel as ``LayerContext.priority``, which the shared top-k
    (:func:`~ragsnap.compression.base.keep_top`), word completion and the role press honour
    (inside each role's quota); the wrapped press's own scores order positions within a
    tier. ``from_tier`` leaves the tiers below it to the base press: 2 (the default) ranks the
    record's values and the named field first, not its keys and delimiters (on 12 generated
    inventories that kept the asked value as well as 1 did, with the budget freed for the
    base press's own choice); 1 ranks the whole record first. A prompt without focus (prose,
    no record named) is compressed by ``base`` alone.
    """

    name = "lookup"
    base: Press
    from_tier: int = 2

    def __post_init__(self) -> None:
        if not 1 <= self.from_tier <= 4:
            raise ConfigError(f"from_tier must be in 1..4, got {self.from_tier}", field="from_tier")

    def config(self) -> dict[str, Any]:
        return {**self.base.config(), "lookup": True, "from_tier": self.from_tier}

    def compress(self, layer: LayerContext) -> CompressedLayer:
        if layer.focus is None:
            return self.base.compress(layer)
        priority = layer.focus * (layer.focus >= self.from_tier)
        # same memo, so scores computed by other presses on this layer are reused
        return self.base.compress(dataclasses.replace(layer, priority=priority))


def uses_focus(*presses: Press) -> bool:
    """Whether any of ``presses``, or a press they wrap (``.base``), is a
    :class:`LookupFocusPress`: callers compute the focus only then."""
    for press in presses:
        current: Any = press
        while current is not None:
            if isinstance(current, LookupFocusPress):
                return True
            current = getattr(current, "base", None)
    return False
