"""Command-line flags generated from :class:`~ragsnap.engine.config.EngineConfig`'s fields.

A flag is ``--field-name`` (a few keep shorter names: ``--cache``, ``--press``,
``--max-new-tokens``), its help is the field's description, its choices the field's
literal values; flags left out are None, so the environment (``RAGSNAP_*``) and then the
field's default decide, exactly as for the server. Values are checked when the config is
built, with the setting named.
"""

from __future__ import annotations

import argparse
import math
import types
import typing
from collections.abc import Iterable
from typing import Any, Literal, overload

from pydantic_settings import BaseSettings

from ragsnap.engine.config import Config, EngineConfig, configured
from ragsnap.errors import ConfigError

FLAG_NAMES = {
    "cache_url": "--cache",
    "corpus_dir": "--corpus",
    "default_press": "--press",
    "default_max_new_tokens": "--max-new-tokens",
}

MODEL_FIELDS = ("model", "device", "dtype", "matmul_precision", "four_bit_weights")
CACHE_FIELDS = (
    "cache_url",
    "storage_dtype",
    "prefix_storage_dtype",
    "prefix_cache",
    "prefix_store",
    "document_cache",
    "recompute_share",
    "recompute_select",
    "prefix_memory_mb",
    "hit_memory_mb",
)
DECODE_FIELDS = ("speculate", "speculate_ngrams", "commit_lookahead")
# the press settings (PressSettings): the press, its size (one of two), its tuning
PRESS_SIZE_FIELDS = ("budget", "ratio")
PRESS_TUNING_FIELDS = (
    "window",
    "kernel",
    "pooling",
    "layer_profile",
    "keep_instruction",
    "lookup",
    "lookahead",
    "propagate_layer",
    "propagate_share",
    "full_prefill",
    "decode_slack",
    "decode_window",
)
PRESS_FIELDS = ("default_press", *PRESS_SIZE_FIELDS, *PRESS_TUNING_FIELDS)
SERVED_FIELDS = (*PRESS_FIELDS, "document_order", "unsupported")


def flag_of(name: str) -> str:
    return FLAG_NAMES.get(name, "--" + name.replace("_", "-"))


def _value_type(annotation: Any) -> Any:
    """The annotation without ``None`` (``int | None`` -> ``int``)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    is_union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    return args[0] if is_union and len(args) == 1 else annotation


def _bounds(field: Any) -> tuple[float, float] | None:
    """``(ge, le)`` of a field constrained on both sides, else None."""
    low = next((m.ge for m in field.metadata if getattr(m, "ge", None) is not None), None)
    high = next((m.le for m in field.metadata if getattr(m, "le", None) is not None), None)
    return None if low is None or high is None else (low, high)


def number_in(low: float, high: float, *, low_open: bool = False) -> Any:
    """An argparse ``type``: a finite float in ``[low, high]`` (``(low, high]`` with
    ``low_open``), refused while the command line is parsed (before any model loads)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        below = value <= low if low_open else value < low
        if not math.isfinite(value) or below or value > high:
            opening = "(" if low_open else "["
            raise argparse.ArgumentTypeError(f"{text!r} is outside {opening}{low:g}, {high:g}]")
        return value

    return parse


def add_config_options(
    parser: argparse._ActionsContainer,
    names: Iterable[str],
    config: type[BaseSettings] = EngineConfig,
) -> None:
    """Add a flag for each field ``names`` lists (see the module docstring)."""
    for name in names:
        field = config.model_fields[name]
        kind = _value_type(field.annotation)
        default = field.default if field.default is not None else "unset"
        help_text = f"{field.description} (default: {default}; $RAGSNAP_{name.upper()})"
        options: dict[str, Any] = {"dest": name, "default": None, "help": help_text}
        if kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) is Literal:
            options["choices"] = typing.get_args(kind)
        else:
            options["metavar"] = flag_of(name)[2:].upper().replace("-", "_")
            bounds = _bounds(field)
            if kind is float and bounds is not None:
                options["type"] = number_in(*bounds)
            elif kind in (int, float):
                options["type"] = kind
        parser.add_argument(flag_of(name), **options)
        parser.set_defaults(**{_GENERATED + name: True})


# marks, in the parsed namespace, the press settings whose flags were generated here: a
# command's own flag of the same name (``eval --budget 128,256``) is not the setting
_GENERATED = "_generated_flag_"


def given_fields(
    args: argparse.Namespace, config: type[BaseSettings] = EngineConfig
) -> dict[str, Any]:
    """The fields of ``config`` that ``args`` gives a value (flags left out are None; a
    press setting only through its generated flag)."""
    return {
        name: getattr(args, name)
        for name in config.model_fields
        if getattr(args, name, None) is not None
        and (name not in PRESS_FIELDS or getattr(args, _GENERATED + name, False))
    }


@overload
def config_from_args(args: argparse.Namespace, **given: Any) -> EngineConfig: ...


@overload
def config_from_args(args: argparse.Namespace, config: type[Config], **given: Any) -> Config: ...


def config_from_args(
    args: argparse.Namespace,
    config: type[BaseSettings] = EngineConfig,
    **given: Any,
) -> BaseSettings:
    """``config`` from the flags given in ``args`` (then ``given``, then ``RAGSNAP_*``); a
    bad flag value is a :class:`ConfigError` naming the flag."""
    flags = given_fields(args, config)
    try:
        return configured(config, **{**flags, **given})
    except ConfigError as exc:
        if exc.field not in flags:
            raise
        message = exc.message.removeprefix(f"setting {exc.field}: ")
        raise ConfigError(f"{flag_of(exc.field)}: {message}", field=exc.field) from None
