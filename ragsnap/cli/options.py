"""Command-line options shared by several subcommands."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from ragsnap.compression import Press
from ragsnap.engine.config import EngineConfig, configured
from ragsnap.engine.options import (
    CACHE_FIELDS,
    DECODE_FIELDS,
    MODEL_FIELDS,
    PRESS_SIZE_FIELDS,
    PRESS_TUNING_FIELDS,
    add_config_options,
    number_in,
)
from ragsnap.engine.request_options import resolve_press
from ragsnap.runtime.generation import MAX_TEMPERATURE, SEED_MAX, SEED_MIN, GenerationConfig

if TYPE_CHECKING:
    from ragsnap.cache.backends.store import KVStore


def seed_value(text: str) -> int:
    """An argparse ``type``: a signed 64-bit integer."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not SEED_MIN <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"{text} is not a signed 64-bit integer")
    return value


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """``--model``, ``--device``, ``--dtype``, ``--matmul-precision``, ``--four-bit-weights``
    (engine config fields)."""
    add_config_options(parser, MODEL_FIELDS)


def add_dtype_option(parser: argparse.ArgumentParser) -> None:
    """``--dtype`` and ``--matmul-precision`` (for benchmarks, which take their own
    ``--model`` and ``--device``); left out, the configuration decides when the command
    runs (``RAGSNAP_*``, else the default)."""
    add_config_options(parser, ("dtype", "matmul_precision"))


def add_press_options(parser: argparse.ArgumentParser) -> None:
    """``--press``, ``--budget`` | ``--ratio`` and the tuning options: flags of the engine
    configuration's press settings (:class:`~ragsnap.engine.press_settings.PressSettings`)."""
    group = parser.add_argument_group("compression")
    add_config_options(group, ("default_press",))
    add_config_options(group.add_mutually_exclusive_group(), PRESS_SIZE_FIELDS)
    add_press_tuning_options(group)


def add_press_tuning_options(group: argparse._ActionsContainer) -> None:
    """The press options beside the press and its size (shared by ``ask`` and ``eval``)."""
    add_config_options(group, PRESS_TUNING_FIELDS)


def press_tuning_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The :func:`add_press_tuning_options` values as :func:`make_press` options (None when
    not given, so each press keeps its default)."""
    return {
        "window": args.window,
        "kernel": args.kernel,
        "pooling": args.pooling,
        "profile": args.layer_profile,
        "keep_instruction": getattr(args, "keep_instruction", False) or None,
        "lookup": getattr(args, "lookup", False) or None,
        "lookahead": getattr(args, "lookahead", None),
        "propagate_layer": getattr(args, "propagate_layer", None),
        "propagate_share": getattr(args, "propagate_share", None),
    }


def add_document_order_option(parser: argparse.ArgumentParser) -> None:
    add_config_options(parser, ("document_order",))


def add_generation_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("generation")
    add_config_options(group, ("default_max_new_tokens",))
    group.add_argument(
        "--temperature",
        type=number_in(0.0, MAX_TEMPERATURE),
        default=0.0,
        help=f"0 = greedy; at most {MAX_TEMPERATURE:g}",
    )
    group.add_argument(
        "--top-p",
        type=number_in(0.0, 1.0, low_open=True),
        default=1.0,
        help="nucleus sampling mass",
    )
    group.add_argument("--seed", type=seed_value, help="sampling seed (reproducible answers)")
    group.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="end the answer before this text (repeatable, at most 4), as the API's `stop`",
    )
    add_config_options(group, DECODE_FIELDS)


def press_from_args(args: argparse.Namespace, config: EngineConfig) -> Press:
    """The press of ``config`` (built from ``args``: the press flags are its fields), as
    every entrance resolves it (:func:`~ragsnap.engine.request_options.resolve_press`)."""
    return resolve_press(config)


def generation_from_args(args: argparse.Namespace, config: EngineConfig) -> GenerationConfig:
    return GenerationConfig(
        max_new_tokens=args.default_max_new_tokens or config.default_max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        stop=tuple(getattr(args, "stop", ())),
    )


def add_cache_options(parser: argparse.ArgumentParser, *, prefix_flag: bool = True) -> None:
    group = parser.add_argument_group("cache")
    add_config_options(group, ("cache_url",))
    group.add_argument("--namespace", default="default", help="cache namespace (tenant)")
    if prefix_flag:
        add_config_options(group, CACHE_FIELDS[1:])


def open_store_from_args(args: argparse.Namespace) -> KVStore:
    """The KV store ``--cache`` (else ``RAGSNAP_CACHE_URL``...) names, sealed with
    ``RAGSNAP_CACHE_KEY`` when set."""
    from ragsnap.cache import open_store

    config = configured(EngineConfig, cache_url=args.cache_url)
    return open_store(config.cache_url, key=config.cache_secret)
