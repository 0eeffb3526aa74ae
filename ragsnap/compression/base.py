"""The press interface: what a compression method sees for one layer, and what it returns.

A press looks at one attention layer at the end of prefill (:class:`LayerContext`) and
returns the entries to keep (:class:`CompressedLayer`). Score-based presses subclass
:class:`ScorerPress` and only implement ``score``; the budget, the protected observation
window and the ordering of kept positions live here once.

Shapes use ``B`` batch, ``Hq`` query heads, ``Hkv`` KV heads, ``G = Hq / Hkv`` the GQA group
size, ``L`` keys in the layer's cache, ``q`` tokens in this forward pass, ``D`` head dim.
"""

from __future__ import annotations

import math
import sys
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field, is_dataclass
from typing import Any, ClassVar

import torch

from ragsnap.compression.kept import CompressedLayer
from ragsnap.errors import ConfigError

# every press's default size and observation window, and the SnapKV pooling kernel, written
# once: the presses' dataclasses and factories, and the engine configuration
# (:class:`ragsnap.engine.press_settings.PressSettings`), read them from here
DEFAULT_BUDGET = 512  # tokens kept per KV head, window included
DEFAULT_WINDOW = 32  # SnapKV's official experiment configs
DEFAULT_KERNEL = 7


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _default_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def project_queries(
    module: Any,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """Recompute an attention module's queries, RoPE applied.

    sdpa and flash-attn return no attention weights, so presses rebuild the queries they
    need from the layer input: ``q_proj`` (+ ``q_norm`` where the model has one), then the
    model's own ``apply_rotary_pos_emb`` (found in the module's source module).

    Parameters
    ----------
    hidden_states : ``[B, n, hidden]`` the attention module's input for ``n`` positions.
    position_embeddings : ``(cos, sin)``, each ``[B, n, D]``.

    Returns
    -------
    ``[B, Hq, n, D]`` float queries.
    """
    batch, n, _ = hidden_states.shape
    head_dim = module.head_dim
    queries = module.q_proj(hidden_states).view(batch, n, -1, head_dim)
    q_norm = getattr(module, "q_norm", None)
    if q_norm is not None:  # Qwen3, Gemma3: RMSNorm over head_dim, before RoPE
        queries = q_norm(queries)
    queries = queries.transpose(1, 2)
    cos, sin = position_embeddings
    rope = getattr(sys.modules[type(module).__module__], "apply_rotary_pos_emb", _default_rope)
    queries, _ = rope(queries, queries, cos, sin)
    return queries


@dataclass
class LayerContext:
    """One attention layer at the end of prefill: everything a press may score with.

    ``keys``/``values`` hold every cached position (a reused document prefix included);
    ``hidden_states`` and ``position_embeddings`` cover only the ``q`` positions of this
    forward pass, which are the last ``q`` of the ``L`` cached ones.
    """

    layer_idx: int
    num_layers: int
    module: Any  # the attention nn.Module (q_proj, head_dim, config, optional q_norm)
    keys: torch.Tensor  # [B, Hkv, L, D], RoPE applied
    values: torch.Tensor  # [B, Hkv, L, D]
    hidden_states: torch.Tensor  # [B, q, hidden]
    position_embeddings: tuple[torch.Tensor, torch.Tensor]  # ([B, q, D], [B, q, D])
    word_starts: torch.Tensor | None = None  # [L] bool: position starts a whitespace-delimited word
    roles: torch.Tensor | None = (
        None  # [L] uint8 TokenRole codes (ragsnap.prompt.structure), or None
    )
    protected: torch.Tensor | None = (
        None  # [L] bool: positions a press must keep (KeepInstructionPress)
    )
    focus: torch.Tensor | None = (
        None  # [L] uint8 tiers of the records the question names (ragsnap.prompt.focus)
    )
    priority: torch.Tensor | None = (
        None  # [L] uint8 tiers a press ranks first, higher first (LookupFocusPress)
    )
    drafted: torch.Tensor | None = (
        None  # [B, Hq, k, D] queries of k tokens drafted after the prompt (LookaheadPress)
    )
    ahead: int = 0  # how many of the drafted queries vote beside the window (LookaheadPress)
    _memo: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def seq_len(self) -> int:
        return self.keys.shape[-2]

    @property
    def num_kv_heads(self) -> int:
        return self.keys.shape[1]

    @property
    def num_query_heads(self) -> int:
        return self.module.config.num_attention_heads

    @property
    def group_size(self) -> int:
        return self.num_query_heads // self.num_kv_heads

    @property
    def scaling(self) -> float:
        """The softmax scale the model itself uses (1/sqrt(D) unless the model says otherwise)."""
        return float(getattr(self.module, "scaling", self.keys.shape[-1] ** -0.5))

    def queries(self, last: int | None = None) -> torch.Tensor:
        """Queries of the last ``last`` positions of this forward (all when None): ``[B, Hq, n, D]``.

        Memoized, so several presses scoring the same layer project the queries once.
        """
        n = self.hidden_states.shape[1] if last is None else last
        if n > self.hidden_states.shape[1]:
            raise ValueError(
                f"need the queries of the last {n} positions, but this forward only has "
                f"{self.hidden_states.shape[1]}"
            )
        key = f"queries:{n}"
        if key not in self._memo:
            cos, sin = self.position_embeddings
            self._memo[key] = project_queries(
                self.module,
                self.hidden_states[:, -n:],
                (cos[:, -n:], sin[:, -n:]),
            )
        return self._memo[key]


class Press(ABC):
    """A KV-cache compression method applied to each layer at the end of prefill."""

    name: ClassVar[str]
    # True when the selection depends only on the keys and the observation window's queries:
    # then prefilling just the question over a reused document prefix selects the same entries
    window_only: ClassVar[bool] = True

    @abstractmethod
    def compress(self, layer: LayerContext) -> CompressedLayer:
        """Return what to keep of ``layer``."""

    def config(self) -> dict[str, Any]:
        """The press name and hyper-parameters: part of the cache key and of every report."""
        values: dict[str, Any] = asdict(self) if is_dataclass(self) else {}
        return {"press": self.name, **values}


class WrapperPress(Press):
    """A press around another one, ``self.base`` (a dataclass field of each subclass): its
    observation window, and whether only that window votes, are the base press's."""

    base: Press

    @property
    def window_only(self) -> bool:  # type: ignore[override]
        return self.base.window_only

    @property
    def window(self) -> int:
        """The base press's observation window (0 when it has none)."""
        return int(getattr(self.base, "window", 0))


@dataclass
class ScorerPress(Press):
    """Keep the highest-scoring positions plus the last ``window`` positions of the prompt.

    The budget is a token count per KV head, window included (``budget``), or a share of
    the prompt (``ratio``); a prompt that fits the budget is kept whole.
    """

    budget: int | None = DEFAULT_BUDGET
    ratio: float | None = None
    window: int = DEFAULT_WINDOW

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ConfigError(f"window must be at least 1, got {self.window}", field="window")
        if (self.budget is None) == (self.ratio is None):
            raise ConfigError("give exactly one of budget or ratio", field="budget")
        if self.budget is not None and self.budget < self.window:
            raise ConfigError(
                f"budget ({self.budget}) must be at least the window ({self.window})",
                field="budget",
            )
        if self.ratio is not None and not 0.0 < self.ratio <= 1.0:
            raise ConfigError(f"ratio must be in (0, 1], got {self.ratio}", field="ratio")

    def layer_budget(self, layer: LayerContext) -> int:
        """Tokens to keep per KV head in ``layer`` (window included)."""
        if self.budget is not None:
            return self.budget
        assert self.ratio is not None
        return max(self.window, math.ceil(self.ratio * layer.seq_len))

    @abstractmethod
    def score(self, layer: LayerContext) -> torch.Tensor:
        """Scores of the ``L - window`` positions before the window: ``[B, Hkv, L - window]``."""

    def compress(self, layer: LayerContext) -> CompressedLayer:
        keep = self.layer_budget(layer)
        if layer.seq_len <= keep:
            return keep_all(layer)
        return keep_top(layer, self.score(layer), keep, self.window)


def keep_all(layer: LayerContext) -> CompressedLayer:
    """Every position of every head (a prompt that fits the budget)."""
    batch, heads = layer.keys.shape[:2]
    indices = torch.arange(layer.seq_len, device=layer.keys.device).expand(batch, heads, -1)
    return CompressedLayer.gather(layer.keys, layer.values, indices)


def prioritize(layer: LayerContext, scores: torch.Tensor) -> torch.Tensor:
    """``scores`` (``[B, Hkv, n]``, prefix positions) ranked by ``layer.priority`` tier first.

    Each tier is lifted above the whole range of the scores of each head, so a higher tier
    always ranks first and the scores still order positions inside a tier. Without
    priorities (or all zero) the scores come back unchanged.
    """
    if layer.priority is None:
        return scores
    tiers = layer.priority[: scores.shape[-1]].to(device=scores.device, dtype=scores.dtype)
    if not bool(tiers.any()):
        return scores
    finite = scores.masked_fill(~torch.isfinite(scores), 0.0)
    span = (finite.amax(-1, keepdim=True) - finite.amin(-1, keepdim=True)).clamp_min(0) + 1.0
    return scores + tiers * span


def protect(layer: LayerContext, scores: torch.Tensor) -> torch.Tensor:
    """``scores`` (``[B, Hkv, n]``, prefix positions) ranked by ``layer.priority`` tiers
    (:func:`prioritize`), with ``layer.protected`` ones raised to +inf."""
    scores = prioritize(layer, scores)
    if layer.protected is None:
        return scores
    mask = layer.protected[: scores.shape[-1]].to(scores.device)
    return scores.masked_fill(mask, float("inf"))


def keep_top(layer: LayerContext, scores: torch.Tensor, keep: int, window: int) -> CompressedLayer:
    """Keep the ``keep - window`` best-scoring prefix positions per head plus the last ``window``.

    ``scores`` is ``[B, Hkv, L - window]``; kept indices come back in positional order.
    Positions in ``layer.protected`` come first (the instruction kept whatever the press).
    """
    seq_len = layer.seq_len
    batch, heads = layer.keys.shape[:2]
    window = min(window, seq_len)
    scores = protect(layer, scores)
    top = scores.topk(keep - window, dim=-1).indices
    recent = torch.arange(seq_len - window, seq_len, device=layer.keys.device)
    indices = torch.cat([top, recent.expand(batch, heads, -1)], dim=-1).sort(dim=-1).values
    return CompressedLayer.gather(layer.keys, layer.values, indices)
