"""A request's options: what it asks for over the configuration's defaults, resolved once.

The CLI (``ragsnap ask``), the API routes, Ray replicas, LangChain's in-process model and
:meth:`RagSnapEngine.default_options` all call :func:`answer_options`, so a request that
leaves a setting unset gets the same press, answer length, document order and abstention
through each of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ragsnap.citations.options import CitationOptions
from ragsnap.compression import Press, make_press, press_options
from ragsnap.compression.decode_snapkv import DecodeSnapKV, decode_compression
from ragsnap.compression.propagate import without_propagation
from ragsnap.engine.config import EngineConfig
from ragsnap.engine.prepared import AnswerOptions
from ragsnap.engine.press_settings import PressOverrides
from ragsnap.prompt.assembly import DocumentOrder
from ragsnap.runtime.generation import GenerationConfig

# a request's value of these must suit the press (an error otherwise); the configuration's
# goes only to the presses that take it (one server setting, many presses)
_TUNING = ("window", "kernel", "pooling")
_WRAPPERS = ("keep_instruction", "lookup", "lookahead", "propagate_layer", "propagate_share")


def _given(value: Any, default: Any) -> Any:
    return default if value is None else value


def resolve_press(config: EngineConfig, overrides: PressOverrides | None = None) -> Press:
    """The press ``overrides`` ask for over ``config``'s press settings. A size (``budget``
    or ``ratio``) given replaces the configured one as a pair; a budget below the window
    (either given or configured) shrinks the window to it. Raises
    :class:`~ragsnap.errors.ConfigError` naming the option a press refuses."""
    given = overrides or PressOverrides()
    name = given.press or config.default_press
    if name == "full":
        return make_press("full")
    takes = press_options(name)
    sized = given.budget is not None or given.ratio is not None
    options: dict[str, Any] = {
        "budget": given.budget if sized else config.budget,
        "ratio": given.ratio if sized else config.ratio,
    }
    for key in (*_TUNING, *_WRAPPERS):
        value = getattr(given, key)
        if value is not None:
            options[key] = value
        elif key in takes:
            options[key] = getattr(config, key)
    if "profile" in takes:
        options["profile"] = config.layer_profile
    if options["budget"] is not None and options.get("window", 0) > options["budget"]:
        # the budget is what is kept, window included: a smaller one shrinks the window
        options["window"] = options["budget"]
    press = make_press(name, **options)
    return without_propagation(press) if given.full_prefill or config.full_prefill else press


def resolve_decode(
    config: EngineConfig, overrides: PressOverrides | None = None
) -> DecodeSnapKV | None:
    """Decode-phase SnapKV as ``overrides`` ask over ``config`` (None: off); a window over
    the slack (either given or configured) is the slack."""
    given = overrides or PressOverrides()
    slack = _given(given.decode_slack, config.decode_slack)
    window = _given(given.decode_window, config.decode_window)
    if slack is not None and window is not None:
        window = min(window, slack)  # the answer tokens that vote fit in the slack
    return decode_compression(slack, window)


def answer_options(
    config: EngineConfig,
    compression: PressOverrides | None = None,
    *,
    press: Press | None = None,
    generation: GenerationConfig | Mapping[str, Any] | None = None,
    citations: CitationOptions | Mapping[str, Any] | None = None,
    document_order: DocumentOrder | None = None,
    **given: Any,
) -> AnswerOptions:
    """The options of one request: ``compression`` (press fields a request changes) or a
    built ``press`` (the configuration's full-prefill switch still applies); ``generation``
    (a :class:`GenerationConfig`, or its fields, ``max_new_tokens`` None: the configured
    length); ``citations`` (:class:`CitationOptions`, or its fields over the configured
    ``unsupported`` and ``abstain_text``); ``document_order``; the other
    :class:`AnswerOptions` fields as keywords (``chat``, ``kept_tokens``,
    ``decode_compression``). Raises :class:`~ragsnap.errors.ConfigError` for a bad value."""
    if press is None:
        press = resolve_press(config, compression)
    elif config.full_prefill:
        press = without_propagation(press)
    if "decode_compression" not in given:
        given["decode_compression"] = resolve_decode(config, compression)
    if not isinstance(generation, GenerationConfig):
        fields = dict(generation or {})
        tokens = fields.pop("max_new_tokens", None)
        generation = GenerationConfig(
            max_new_tokens=_given(tokens, config.default_max_new_tokens), **fields
        )
    if not isinstance(citations, CitationOptions):
        fields = {k: v for k, v in (citations or {}).items() if v is not None}
        citations = CitationOptions(
            **{"unsupported": config.unsupported, "abstain_text": config.abstain_text, **fields}
        )
    return AnswerOptions(
        press=press,
        generation=generation,
        citations=citations,
        document_order=document_order or config.document_order,
        **given,
    )


def with_unsupported(citations: CitationOptions, unsupported: str | None) -> CitationOptions:
    """``citations`` with ``unsupported`` when given."""
    return (
        citations
        if unsupported is None
        else dataclasses.replace(citations, unsupported=unsupported)
    )
