"""SnapKV while decoding: the last generated tokens vote again once a cache has grown.

A compressed prompt cache grows by one entry per generated token, so a long answer
(a BioASQ "ideal" answer of 256 tokens on a budget of 128) ends with most of its cache
spent on the answer itself. With :class:`DecodeSnapKV` a row keeps, per layer, at most
the length it started decoding with plus ``slack`` entries: when a layer reaches that,
the attention of the row's last ``window`` generated tokens (recorded as they were
decoded, averaged over the query heads of each KV group, max-pooled along positions like
SnapKV's) picks which earlier entries stay, and the last ``window`` entries always do.
Selection is per KV head; an entry keeps its Attention Matching bias. Sliding-window
layers already bound themselves and are left alone.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from ragsnap.compression.base import DEFAULT_KERNEL
from ragsnap.compression.snapkv import pool_scores
from ragsnap.errors import ConfigError

DEFAULT_DECODE_WINDOW = 16  # answer tokens that vote (at most the slack)


@dataclass(frozen=True)
class DecodeSnapKV:
    """Settings: ``slack`` entries of growth per layer before a re-selection, the
    ``window`` of last tokens that vote (and are always kept), the pooling ``kernel``."""

    slack: int = 64
    window: int = DEFAULT_DECODE_WINDOW
    kernel: int = DEFAULT_KERNEL

    def __post_init__(self) -> None:
        if not 1 <= self.window <= self.slack:
            raise ConfigError(
                f"decode window must be between 1 and the slack ({self.slack}), got {self.window}",
                field="decode_window",
            )
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ConfigError(f"kernel must be odd and >= 1, got {self.kernel}", field="kernel")

    def config(self) -> dict[str, int]:
        return {"slack": self.slack, "window": self.window, "kernel": self.kernel}


def decode_compression(slack: int | None, window: int | None = None) -> DecodeSnapKV | None:
    """The settings a user asked for: off without a ``slack``."""
    if slack is None:
        if window is not None:
            raise ConfigError("decode_window needs decode_slack", field="decode_window")
        return None
    return DecodeSnapKV(
        slack=slack, window=window if window is not None else min(DEFAULT_DECODE_WINDOW, slack)
    )


@dataclass
class DecodeVotes:
    """One row's recorded attention: per layer, the last ``window`` steps' ``[Hkv, n_t]``
    votes (``n_t`` = the entries that step saw, its own included)."""

    settings: DecodeSnapKV
    targets: list[int]  # per layer, the length the row started decoding with
    steps: dict[int, deque[torch.Tensor]] = field(default_factory=dict)
    reselections: int = 0  # layer selections made so far

    def record(self, layer: int, probs: torch.Tensor, num_kv_heads: int) -> None:
        """``probs``: ``[Hq, n]`` of this step's query over the row's entries."""
        grouped = probs.view(num_kv_heads, -1, probs.shape[-1]).mean(dim=1)  # [Hkv, n]
        history = self.steps.setdefault(layer, deque(maxlen=self.settings.window))
        history.append(grouped)

    def due(self, layer: int, length: int) -> bool:
        return length > self.targets[layer] + self.settings.slack and layer in self.steps

    def select(self, layer: int, length: int) -> torch.Tensor:
        """Entries to keep of a layer holding ``length``: ``[Hkv, target]``, ascending.

        The last ``window`` entries stay; the others are ranked by the pooled votes.
        """
        history = self.steps.pop(layer)
        self.reselections += 1
        votes = history[0].new_zeros((history[0].shape[0], length))
        for step in history:  # older steps saw fewer entries: their votes align left
            votes[:, : step.shape[-1]] += step
        target = max(self.targets[layer], self.settings.window)
        recent = length - self.settings.window
        pooled = pool_scores(votes[:, :recent].unsqueeze(0), self.settings.kernel, "max")[0]
        chosen = pooled.topk(target - self.settings.window, dim=-1).indices
        tail = torch.arange(recent, length, device=votes.device).expand(votes.shape[0], -1)
        return torch.cat([chosen, tail], dim=-1).sort(dim=-1).values
