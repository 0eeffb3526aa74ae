"""KV-cache compression methods ("presses") and the hooks that apply them during prefill."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

from ragsnap.compression.attention_matching import AttentionMatchingPress
from ragsnap.compression.base import CompressedLayer, LayerContext, Press, ScorerPress
from ragsnap.compression.default import (
    attnmatch_press,
    ragsnap_lookahead_press,
    ragsnap_lookup_press,
    ragsnap_press,
    ragsnap_propagate_press,
    ragsnap_roles_lookup_press,
    ragsnap_roles_press,
    wordspan_press,
)
from ragsnap.compression.full import FullPress
from ragsnap.compression.h2o import H2OPress
from ragsnap.compression.hooks import compression_hooks
from ragsnap.compression.keep_instruction import KeepInstructionPress
from ragsnap.compression.knorm import KeyNormPress
from ragsnap.compression.layer_budgets import LayerBudgetSnapKVPress
from ragsnap.compression.lookahead import LookaheadPress
from ragsnap.compression.lookup_focus import LookupFocusPress
from ragsnap.compression.propagate import PropagatePress, propagation_of, without_propagation
from ragsnap.compression.pyramidkv import PyramidKVPress
from ragsnap.compression.random_press import RandomPress
from ragsnap.compression.role_budget import RoleBudgetPress, roles_press
from ragsnap.compression.snapkv import SnapKVPress
from ragsnap.compression.streamingllm import StreamingLLMPress
from ragsnap.compression.tova import TOVAPress
from ragsnap.errors import ConfigError

# name -> factory taking the press's options as keywords
PRESSES: dict[str, Callable[..., Press]] = {
    "ragsnap": ragsnap_press,
    **{
        cls.name: cls
        for cls in (
            FullPress,
            SnapKVPress,
            StreamingLLMPress,
            H2OPress,
            RandomPress,
            PyramidKVPress,
            LayerBudgetSnapKVPress,
            TOVAPress,
            KeyNormPress,
        )
    },
    "wordspan": wordspan_press,
    "attnmatch": attnmatch_press,
    "roles": roles_press,
    "ragsnap-roles": ragsnap_roles_press,
    "ragsnap-lookup": ragsnap_lookup_press,
    "ragsnap-roles-lookup": ragsnap_roles_lookup_press,
    "ragsnap-lookahead": ragsnap_lookahead_press,
    "ragsnap-propagate": ragsnap_propagate_press,
}
# the default: ragsnap's press, its first 8 answer tokens drafted to vote (LookaheadPress)
DEFAULT_PRESS = "ragsnap-lookahead"


# options every press but ``full`` takes: make_press wraps the press for them
WRAPPER_OPTIONS = frozenset(
    {"keep_instruction", "lookup", "lookahead", "propagate", "propagate_layer", "propagate_share"}
)


@functools.cache
def press_options(name: str) -> frozenset[str]:
    """The options press ``name`` takes: its factory's keywords and
    :data:`WRAPPER_OPTIONS` (``lookahead`` only where the press votes with its window;
    none for ``full``, nothing for an unknown name)."""
    cls = PRESSES.get(name)
    if cls is None or cls is FullPress:
        return frozenset()
    options = frozenset(inspect.signature(cls).parameters) | WRAPPER_OPTIONS
    try:  # LookaheadPress refuses a press whose votes are not its window's (H2O)
        make_press(name, lookahead=1)
    except ConfigError:
        return options - {"lookahead"}
    return options


def make_press(name: str = DEFAULT_PRESS, **options: Any) -> Press:
    """Build a press by name; options that are None are left at the press's default.

    ``keep_instruction=True`` wraps the press in :class:`KeepInstructionPress` (the system
    instruction is kept whatever the press); ``lookup=True`` in :class:`LookupFocusPress`
    (the record a question names on a structured document ranks first); ``lookahead=N`` in
    :class:`LookaheadPress` (the first ``N`` answer tokens, drafted on the full cache, vote
    with the window), or sets ``N`` of a press that already looks ahead (0 turns it off);
    ``propagate=True`` (or ``propagate_layer`` / ``propagate_share``) in
    :class:`PropagatePress` (query-aware prefill; "auto" for what is not given).
    Raises :class:`ConfigError` for an unknown press or an option the press does not take.
    """
    layer, share = options.pop("propagate_layer", None), options.pop("propagate_share", None)
    if options.pop("propagate", None) or layer is not None or share is not None:
        inner = make_press(name, **options)
        if propagation_of(inner) is not None:  # a named press that already propagates
            inner = without_propagation(inner)
        return PropagatePress(
            base=inner,
            layer="auto" if layer is None else layer,
            share="auto" if share is None else share,
        )
    if options.pop("lookup", None):
        return LookupFocusPress(base=make_press(name, **options))
    if options.pop("keep_instruction", None):
        return KeepInstructionPress(base=make_press(name, **options))
    cls = PRESSES.get(name)
    if cls is None:
        raise ConfigError(
            f"unknown press {name!r} (choose from: {', '.join(PRESSES)})", field="press"
        )
    given = {k: v for k, v in options.items() if v is not None}
    if cls is FullPress:
        return FullPress()
    tokens = given.pop("lookahead", None)
    if "ratio" in given and "budget" not in given:
        given["budget"] = None
    accepted = set(inspect.signature(cls).parameters)
    unknown = sorted(set(given) - accepted)
    if unknown:
        raise ConfigError(f"press {name!r} does not take: {', '.join(unknown)}", field=unknown[0])
    press = cls(**given)
    if tokens is None:
        return press
    if isinstance(press, LookaheadPress):  # a named press that already looks ahead
        return dataclasses.replace(press, tokens=tokens) if tokens else press.base
    return LookaheadPress(base=press, tokens=tokens) if tokens else press


__all__ = [
    "PRESSES",
    "PropagatePress",
    "AttentionMatchingPress",
    "DEFAULT_PRESS",
    "CompressedLayer",
    "KeepInstructionPress",
    "KeyNormPress",
    "LayerContext",
    "LookaheadPress",
    "LookupFocusPress",
    "Press",
    "RoleBudgetPress",
    "ScorerPress",
    "TOVAPress",
    "compression_hooks",
    "make_press",
]
