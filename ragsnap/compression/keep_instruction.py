"""Keep the system instruction whatever the press (the KV-compression pitfalls mitigation).

Evicting instruction tokens makes a compressed model ignore its instructions; keeping the
prompt head (everything before the first document, ``TokenRole.INSTRUCTION`` in
``LayerContext.roles``) fixes it at the cost of those few entries of the budget.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ragsnap.compression.base import CompressedLayer, LayerContext, Press, WrapperPress
from ragsnap.compression.roles import TokenRole


@dataclass
class KeepInstructionPress(WrapperPress):
    """Wrap any press: the instruction positions are kept first, the budget stays the same.

    The positions travel as ``LayerContext.protected``, which the shared top-k
    (:func:`~ragsnap.compression.base.keep_top`) and the role press honour, so the wrapped
    press, and every press it wraps in turn, keeps them. Without roles this is ``base``.
    """

    name = "keep-instruction"
    base: Press

    def config(self) -> dict[str, Any]:
        return {**self.base.config(), "keep_instruction": True}

    def compress(self, layer: LayerContext) -> CompressedLayer:
        if layer.roles is None:
            return self.base.compress(layer)
        head = (layer.roles == TokenRole.INSTRUCTION).to(layer.keys.device)  # [L] bool
        if layer.protected is not None:
            head = head | layer.protected.to(head.device)
        # same memo, so scores computed by other presses on this layer are reused
        return self.base.compress(dataclasses.replace(layer, protected=head))
