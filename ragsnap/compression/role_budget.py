"""Role-conditioned budgets: keys and delimiters must not crowd out the values.

On JSON, XML and tables the observation window's attention mass favours delimiters and
keys (about 40x the mass of a value token), so plain top-k keeps the scaffolding and drops
the values an answer needs. Each token role (:class:`~ragsnap.compression.roles.TokenRole`,
from :mod:`ragsnap.prompt.structure`) gets its share of the budget instead, and inside each role
the wrapped scorer's own ranking decides; a role with fewer tokens than its share hands the
rest to the others in proportion to their shares.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from ragsnap.compression.base import (
    DEFAULT_BUDGET,
    DEFAULT_KERNEL,
    DEFAULT_WINDOW,
    CompressedLayer,
    LayerContext,
    ScorerPress,
    WrapperPress,
    keep_all,
    prioritize,
)
from ragsnap.compression.roles import STRUCTURAL, TokenRole
from ragsnap.compression.snapkv import SnapKVPress
from ragsnap.compression.span_completion import SpanCompletionPress
from ragsnap.errors import ConfigError

# the roles that share the budget, in this order (INSTRUCTION tokens count as OTHER)
ROLES = (TokenRole.VALUE, TokenRole.DELIM, TokenRole.OTHER, TokenRole.WS, TokenRole.KEY)


def _water_fill(caps: list[int], weights: list[float], slots: int) -> tuple[list[int], int]:
    """Split ``slots`` in proportion to ``weights``, never above ``caps``; returns the
    quotas and the slots nobody could take. Largest remainders settle the rounding."""
    quota = [0] * len(caps)
    open_ = {i for i, (c, w) in enumerate(zip(caps, weights, strict=True)) if c > 0 and w > 0}
    remaining = slots
    while remaining > 0 and open_:
        total = sum(weights[i] for i in open_)
        ideal = {i: remaining * weights[i] / total for i in open_}
        full = [i for i in open_ if ideal[i] >= caps[i] - quota[i]]
        if full:  # saturated: take everything, the rest is shared again
            for i in full:
                remaining -= caps[i] - quota[i]
                quota[i] = caps[i]
                open_.discard(i)
            continue
        floors = {i: int(ideal[i]) for i in open_}
        order = sorted(open_, key=lambda i: (floors[i] - ideal[i], i))
        for i in open_:
            quota[i] += floors[i]
        for i in order[: remaining - sum(floors.values())]:
            quota[i] += 1
        remaining = 0
    return quota, remaining


def reach_back(scores: torch.Tensor, reach: int) -> torch.Tensor:
    """Each position's best score over itself and the ``reach`` positions before it.

    ``scores`` is ``[B, H, n]``. A value follows its key (``"key": value``, ``| key | value``,
    ``<item key="k"><value>v``), often beyond pooling's ``kernel // 2``; looking back lets a
    value rank by the score of its key.
    """
    if reach <= 0:
        return scores
    flat = F.pad(scores.flatten(0, 1).unsqueeze(1), (reach, 0), value=float("-inf"))
    return F.max_pool1d(flat, kernel_size=reach + 1, stride=1).view_as(scores)


def allocate_quotas(counts: Sequence[int], shares: Sequence[float], slots: int) -> list[int]:
    """Slots per role: ``shares`` of ``slots``, capped by ``counts`` (tokens of each role).

    What a saturated role leaves goes to the unsaturated ones in proportion to their
    shares; roles with share 0 get slots only when every other role is exhausted. The
    quotas sum to ``min(slots, sum(counts))``.
    """
    caps = list(counts)
    quota, remaining = _water_fill(caps, list(shares), slots)
    if remaining > 0:  # only zero-share roles have tokens left
        left = [c - q for c, q in zip(caps, quota, strict=True)]
        extra, _ = _water_fill(left, [float(n) for n in left], remaining)
        quota = [q + e for q, e in zip(quota, extra, strict=True)]
    return quota


@dataclass
class RoleBudgetPress(WrapperPress):
    """Wrap a scorer press: per-role quotas of the budget, top tokens by score inside each role.

    ``base`` scores the prefix (SnapKV's windowed, max-pooled votes by default; a
    :class:`SpanCompletionPress` adds word completion, and entries kept only through it
    are marked ``exact``); shares are normalized by their sum (defaults VALUE 0.70, DELIM
    0.20, OTHER 0.05, WS 0.05, KEY 0.10: keys 0-0.2 per the source material).
    ``reach_back > 0`` ranks every token by the best score of itself and the ``reach_back``
    tokens before it (:func:`reach_back`; 0, the default, is the plain ranking). The budget
    is kept exactly and the window always. A prompt without KEY, VALUE or DELIM tokens (or
    without roles) is compressed by ``base`` alone, exactly as without this press.
    """

    name = "roles"
    base: ScorerPress | SpanCompletionPress = field(default_factory=SnapKVPress)
    value_share: float = 0.70
    delim_share: float = 0.20
    other_share: float = 0.05
    ws_share: float = 0.05
    key_share: float = 0.10
    reach_back: int = 0

    def __post_init__(self) -> None:
        if self.reach_back < 0:
            raise ConfigError("reach_back must be >= 0", field="reach_back")
        for role, share in zip(ROLES, self.shares, strict=True):
            if not 0.0 <= share <= 1.0:
                raise ConfigError(
                    f"{role.name.lower()}_share must be in [0, 1], got {share}",
                    field=f"{role.name.lower()}_share",
                )
        if sum(self.shares) <= 0:
            raise ConfigError("at least one role share must be positive", field="value_share")

    @property
    def shares(self) -> tuple[float, ...]:
        """Shares in :data:`ROLES` order."""
        return (self.value_share, self.delim_share, self.other_share, self.ws_share, self.key_share)

    def layer_budget(self, layer: LayerContext) -> int:
        return self.base.layer_budget(layer)

    def config(self) -> dict[str, Any]:
        shares = {f"{r.name.lower()}_share": s for r, s in zip(ROLES, self.shares, strict=True)}
        return {**self.base.config(), "press": self.name, **shares, "reach_back": self.reach_back}

    def _scores(self, layer: LayerContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Own and ranking scores, ``[B, Hkv, L - w]`` each (they differ under word completion)."""
        if isinstance(self.base, SpanCompletionPress):
            raw, ranked = self.base.completed_scores(layer)
        else:
            raw = ranked = self.base.score(layer)
        return raw, reach_back(ranked, self.reach_back)

    def compress(self, layer: LayerContext) -> CompressedLayer:
        keep = self.base.layer_budget(layer)
        if layer.seq_len <= keep:
            return keep_all(layer)
        window = min(self.base.window, layer.seq_len)
        prefix = layer.seq_len - window
        roles = None if layer.roles is None else layer.roles[:prefix].long()
        structured = roles is not None and bool(
            torch.isin(roles, torch.tensor([int(r) for r in STRUCTURAL])).any()
        )
        if roles is None or not structured or keep <= window:
            return self.base.compress(layer)
        device = layer.keys.device
        raw, ranked = self._scores(layer)  # [B, Hkv, P] each
        completion = raw is not ranked
        ranked = prioritize(layer, ranked)  # the records a question names first, in each role
        batch, heads = ranked.shape[:2]
        codes = roles.to(device).masked_fill(roles.to(device) == TokenRole.INSTRUCTION, 0)
        slots = keep - window
        chosen: list[torch.Tensor] = []  # [B, Hkv, n_i] index sets
        exact: list[torch.Tensor] = []  # [B, Hkv, n_i] bool, kept only through completion
        if layer.protected is not None:  # the instruction first, whatever the roles
            guarded = layer.protected[:prefix].to(device)
            taken = guarded.nonzero().flatten()[:slots]
            chosen.append(taken.expand(batch, heads, -1))
            exact.append(torch.zeros(batch, heads, taken.numel(), dtype=torch.bool, device=device))
            slots -= taken.numel()
            codes = codes.masked_fill(guarded, -1)
        counts = [int((codes == role).sum()) for role in ROLES]
        for role, quota in zip(ROLES, allocate_quotas(counts, self.shares, slots), strict=True):
            if quota == 0:
                continue
            top = ranked.masked_fill(codes != role, float("-inf")).topk(quota, dim=-1)
            chosen.append(top.indices)
            exact.append(raw.gather(-1, top.indices) < top.values[..., -1:])
        recent = torch.arange(prefix, layer.seq_len, device=device).expand(batch, heads, -1)
        chosen.append(recent)
        exact.append(torch.zeros(batch, heads, window, dtype=torch.bool, device=device))
        indices, order = torch.cat(chosen, dim=-1).sort(dim=-1)
        kept = CompressedLayer.gather(layer.keys, layer.values, indices)
        if completion:
            kept.exact = torch.cat(exact, dim=-1).gather(-1, order)
        return kept


def roles_press(
    budget: int | None = DEFAULT_BUDGET,
    ratio: float | None = None,
    window: int = DEFAULT_WINDOW,
    kernel: int = DEFAULT_KERNEL,
    pooling: str = "max",
    value_share: float = 0.70,
    delim_share: float = 0.20,
    other_share: float = 0.05,
    ws_share: float = 0.05,
    key_share: float = 0.10,
    reach_back: int = 0,
) -> RoleBudgetPress:
    """Role-conditioned budgets over SnapKV's scores."""
    snap = SnapKVPress(
        budget=budget,
        ratio=ratio,
        window=window,
        kernel=kernel,
        pooling=pooling,  # type: ignore[arg-type]
    )
    return RoleBudgetPress(
        base=snap,
        value_share=value_share,
        delim_share=delim_share,
        other_share=other_share,
        ws_share=ws_share,
        key_share=key_share,
        reach_back=reach_back,
    )
