"""Lookahead votes: the first answer tokens, drafted on the full cache, vote with the window.

SnapKV's observation window is the question: it knows what is asked, not where the answer
lies. On a lookup ("what is the value of key K?") the question's queries find key K, while
the queries that copy K's value come only once the answer starts. At the end of prefill the
full cache is still there, so the runtime drafts the first ``tokens`` answer tokens greedily
on it (:func:`ragsnap.runtime.prefill.prefill`), keeps each drafted token's queries at every
layer (``LayerContext.drafted``), rolls the cache back to the prompt and compresses: this
wrapper lets those queries vote beside the window in every press built on
:func:`~ragsnap.compression.snapkv.window_attention` (SnapKV, its layer budgets, word
completion, Attention Matching's refit, TOVA). The drafts only vote: decoding starts at the
prompt's end as without them. Cost: ``tokens`` decode steps on the full cache per prompt.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ragsnap.compression.base import CompressedLayer, LayerContext, Press, WrapperPress
from ragsnap.errors import ConfigError

MAX_TOKENS = 64


@dataclass
class LookaheadPress(WrapperPress):
    """Wrap a window-voting press: up to ``tokens`` drafted answer tokens vote too.

    A draft stops early at an end-of-turn token. Where nothing was drafted (a model with
    sliding-window layers, whose cache cannot be rolled back) ``base`` compresses alone.
    """

    name = "lookahead"
    base: Press
    tokens: int = 8

    def __post_init__(self) -> None:
        if not 1 <= self.tokens <= MAX_TOKENS:
            raise ConfigError(
                f"lookahead must be between 1 and {MAX_TOKENS} tokens, got {self.tokens}",
                field="lookahead",
            )
        if not self.base.window_only:
            raise ConfigError(
                f"lookahead needs a press that votes with its observation window; "
                f"{self.base.name!r} scores every prompt query",
                field="lookahead",
            )

    def config(self) -> dict[str, Any]:
        return {**self.base.config(), "lookahead": self.tokens}

    def compress(self, layer: LayerContext) -> CompressedLayer:
        if layer.drafted is None:
            return self.base.compress(layer)
        ahead = min(self.tokens, layer.drafted.shape[2])
        # same memo: window attention is memoized per number of drafted rows
        return self.base.compress(dataclasses.replace(layer, ahead=ahead))


def press_label(config: dict[str, Any]) -> str:
    """A press's name as users name it: the base press, ``-lookahead`` when one drafts
    (the default press, ``ragsnap-lookahead``, shows as such in every answer's stats)."""
    name = str(config.get("press", ""))
    return f"{name}-lookahead" if config.get("lookahead") else name


def lookahead_tokens(*presses: Press) -> int:
    """The most tokens any of ``presses`` (or a press they wrap) wants drafted; 0 for none."""
    most = 0
    for press in presses:
        current: Any = press
        while current is not None:
            if isinstance(current, LookaheadPress):
                most = max(most, current.tokens)
            current = getattr(current, "base", None)
    return most
