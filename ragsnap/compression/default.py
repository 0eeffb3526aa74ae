"""Composite presses: span completion and Attention Matching over SnapKV selection.

``ragsnap`` (the default) = SnapKV scores with profiled layer budgets -> word completion
-> Attention Matching refit. ``layerbudget``, ``wordspan`` and ``attnmatch`` are each
piece alone, for ablations. ``ragsnap-roles`` puts role-conditioned budgets between word
completion and the refit. ``ragsnap-lookup`` and ``ragsnap-roles-lookup`` rank the record a
question names on a structured document first (:class:`LookupFocusPress`);
``ragsnap-lookahead`` lets the first answer tokens vote (:class:`LookaheadPress`);
``ragsnap-propagate`` is that press with query-aware prefill (:class:`PropagatePress`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from ragsnap.compression.attention_matching import (
    DEFAULT_MASS_ITERATIONS,
    DEFAULT_RIDGE,
    AttentionMatchingPress,
)
from ragsnap.compression.base import DEFAULT_BUDGET, DEFAULT_KERNEL, DEFAULT_WINDOW, Press
from ragsnap.compression.layer_budgets import LayerBudgetSnapKVPress
from ragsnap.compression.lookahead import LookaheadPress
from ragsnap.compression.lookup_focus import LookupFocusPress
from ragsnap.compression.propagate import PropagatePress
from ragsnap.compression.role_budget import RoleBudgetPress
from ragsnap.compression.snapkv import SnapKVPress
from ragsnap.compression.span_completion import SpanCompletionPress


@dataclass
class RagSnapPress(AttentionMatchingPress):
    """Attention Matching over word-completed, layer-budgeted SnapKV selection (see :func:`ragsnap_press`)."""

    name = "ragsnap"


@dataclass
class RagSnapRolesPress(AttentionMatchingPress):
    """The default press with role-conditioned budgets (see :func:`ragsnap_roles_press`)."""

    name = "ragsnap-roles"


def wordspan_press(
    budget: int | None = DEFAULT_BUDGET,
    ratio: float | None = None,
    window: int = DEFAULT_WINDOW,
    kernel: int = DEFAULT_KERNEL,
    pooling: Literal["max", "avg"] = "max",
    max_word_tokens: int = 12,
) -> SpanCompletionPress:
    """SnapKV selection with word completion."""
    snap = SnapKVPress(budget=budget, ratio=ratio, window=window, kernel=kernel, pooling=pooling)
    return SpanCompletionPress(base=snap, max_word_tokens=max_word_tokens)


def attnmatch_press(
    budget: int | None = DEFAULT_BUDGET,
    ratio: float | None = None,
    window: int = DEFAULT_WINDOW,
    kernel: int = DEFAULT_KERNEL,
    pooling: Literal["max", "avg"] = "max",
    ridge: float = DEFAULT_RIDGE,
    mass_iterations: int = DEFAULT_MASS_ITERATIONS,
) -> AttentionMatchingPress:
    """SnapKV selection with the Attention Matching bias and value refit."""
    snap = SnapKVPress(budget=budget, ratio=ratio, window=window, kernel=kernel, pooling=pooling)
    return AttentionMatchingPress(base=snap, ridge=ridge, mass_iterations=mass_iterations)


def _completed_layer_budgets(
    budget: int | None,
    ratio: float | None,
    window: int,
    kernel: int,
    pooling: Literal["max", "avg"],
    max_word_tokens: int,
    profile: str,
) -> SpanCompletionPress:
    """The selection under the default press: layer-budgeted SnapKV with word completion."""
    snap = LayerBudgetSnapKVPress(
        budget=budget, ratio=ratio, window=window, kernel=kernel, pooling=pooling, profile=profile
    )
    return SpanCompletionPress(base=snap, max_word_tokens=max_word_tokens)


def ragsnap_press(
    budget: int | None = DEFAULT_BUDGET,
    ratio: float | None = None,
    window: int = DEFAULT_WINDOW,
    kernel: int = DEFAULT_KERNEL,
    pooling: Literal["max", "avg"] = "max",
    max_word_tokens: int = 12,
    ridge: float = DEFAULT_RIDGE,
    mass_iterations: int = DEFAULT_MASS_ITERATIONS,
    profile: str = "auto",
) -> RagSnapPress:
    """The default: SnapKV scores under profiled layer budgets, word completion, then
    Attention Matching.

    Layer budgets follow the model's packaged sensitivity profile (``profile="auto"``;
    uniform for a model without one). Values of tokens kept only through word completion
    are left exact (the refit would otherwise blur digits of a kept number at small budgets).
    """
    spans = _completed_layer_budgets(
        budget, ratio, window, kernel, pooling, max_word_tokens, profile
    )
    return RagSnapPress(base=spans, ridge=ridge, mass_iterations=mass_iterations)


def ragsnap_roles_press(
    budget: int | None = DEFAULT_BUDGET,
    ratio: float | None = None,
    window: int = DEFAULT_WINDOW,
    kernel: int = DEFAULT_KERNEL,
    pooling: Literal["max", "avg"] = "max",
    max_word_tokens: int = 12,
    ridge: float = DEFAULT_RIDGE,
    mass_iterations: int = DEFAULT_MASS_ITERATIONS,
    profile: str = "auto",
    value_share: float = 0.70,
    delim_share: float = 0.20,
    other_share: float = 0.05,
    ws_share: float = 0.05,
    key_share: float = 0.10,
    reach_back: int = 0,
) -> RagSnapRolesPress:
    """The default press, with each token role's share of every layer's budget.

    Profiled layer budgets and word-completed SnapKV scores rank the tokens inside each
    role; Attention Matching refits what is kept. On prose this is ``ragsnap``'s selection.
    """
    spans = _completed_layer_budgets(
        budget, ratio, window, kernel, pooling, max_word_tokens, profile
    )
    roles = RoleBudgetPress(
        base=spans,
        value_share=value_share,
        delim_share=delim_share,
        other_share=other_share,
        ws_share=ws_share,
        key_share=key_share,
        reach_back=reach_back,
    )
    return RagSnapRolesPress(base=roles, ridge=ridge, mass_iterations=mass_iterations)


def wrapped(
    factory: Callable[..., Press], wrapper: Callable[[Press], Press], name: str
) -> Callable[..., Press]:
    """``factory`` wrapped by ``wrapper``, taking the same options (its signature is
    ``factory``'s, so :func:`~ragsnap.compression.make_press` checks them)."""

    @functools.wraps(factory)
    def build(**options: Any) -> Press:
        return wrapper(factory(**options))

    build.__name__ = build.__qualname__ = name
    build.__doc__ = f"``{factory.__name__}`` wrapped: {wrapper.__doc__}"
    return build


def _lookup(press: Press) -> Press:
    """the record a structured lookup names ranks first (:class:`LookupFocusPress`)."""
    return LookupFocusPress(base=press)


def _lookahead(press: Press) -> Press:
    """the first 8 answer tokens, drafted on the full cache, vote (:class:`LookaheadPress`)."""
    return LookaheadPress(base=press)


ragsnap_lookup_press = wrapped(ragsnap_press, _lookup, "ragsnap_lookup_press")
ragsnap_roles_lookup_press = wrapped(ragsnap_roles_press, _lookup, "ragsnap_roles_lookup_press")
ragsnap_lookahead_press = wrapped(ragsnap_press, _lookahead, "ragsnap_lookahead_press")


def _propagate(press: Press) -> Press:
    """only the window's chosen tokens run past the calibrated layer (:class:`PropagatePress`)."""
    return PropagatePress(base=press)


ragsnap_propagate_press = wrapped(ragsnap_lookahead_press, _propagate, "ragsnap_propagate_press")
