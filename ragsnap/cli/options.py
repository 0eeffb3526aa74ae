"""Command-line options shared by several subcommands."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from ragsnap.compression import DEFAULT_PRESS, PRESSES, Press, make_press
from ragsnap.compression.propagate import without_propagation
from ragsnap.engine.config import EngineConfig, configured
from ragsnap.engine.options import (
    CACHE_FIELDS,
    DECODE_FIELDS,
    MODEL_FIELDS,
    add_config_options,
    number_in,
)
from ragsnap.errors import ConfigError
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
    """``--model``, ``--device``, ``--dtype``, ``--matmul-precision`` (engine config fields)."""
    add_config_options(parser, MODEL_FIELDS)


def add_dtype_option(parser: argparse.ArgumentParser) -> None:
    """``--dtype`` and ``--matmul-precision`` (for benchmarks, which take their own
    ``--model`` and ``--device``); left out, the configuration decides when the command
    runs (``RAGSNAP_*``, else the default)."""
    add_config_options(parser, ("dtype", "matmul_precision"))


def add_press_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("compression")
    group.add_argument(
        "--press",
        dest="default_press",
        metavar="NAME",
        help=f"one of: {', '.join(PRESSES)} (default: {DEFAULT_PRESS}; $RAGSNAP_DEFAULT_PRESS)",
    )
    size = group.add_mutually_exclusive_group()
    size.add_argument(
        "--budget", type=int, help="tokens kept per KV head, window included (default 512)"
    )
    size.add_argument("--ratio", type=float, help="share of the prompt kept per KV head, in (0, 1]")
    add_press_tuning_options(group)


def add_press_tuning_options(group: argparse._ActionsContainer) -> None:
    """The press options beside the press and its size (shared by ``ask`` and ``eval``)."""
    group.add_argument(
        "--window",
        type=int,
        help="observation window: last prompt tokens that vote, always kept (default 32)",
    )
    group.add_argument("--kernel", type=int, help="pooling kernel, odd (default 7)")
    group.add_argument(
        "--pooling", choices=("max", "avg"), help="pooling of the votes along positions"
    )
    group.add_argument(
        "--layer-profile",
        help="ragsnap / layerbudget: 'auto' (packaged profile), 'uniform', or a profile JSON "
        "from 'ragsnap calibrate'",
    )
    group.add_argument(
        "--keep-instruction",
        action="store_true",
        help="always keep the system instruction's tokens, whatever the press",
    )
    group.add_argument(
        "--lookup",
        action="store_true",
        help="on structured documents, keep first the record the question names "
        "(its key, attribute or cell matched against the question's words)",
    )
    group.add_argument(
        "--lookahead",
        type=int,
        metavar="N",
        help="draft the first N answer tokens on the full cache and let them vote with the "
        "window (the default press drafts 8; 0 turns it off)",
    )
    group.add_argument(
        "--propagate-layer",
        type=int,
        metavar="S",
        help="query-aware prefill: layers 1..S see every prompt token, later ones only the "
        "share the window chose (default: the model's calibrated s; implies propagation)",
    )
    group.add_argument(
        "--propagate-share",
        type=float,
        metavar="P",
        help="query-aware prefill: share of the prompt's tokens past layer S, in (0, 1] "
        "(default: the model's calibrated p; implies propagation)",
    )
    add_config_options(group, ("full_prefill",))
    group.add_argument(
        "--decode-slack",
        type=int,
        help="decode-phase SnapKV: select again once a layer holds this many entries more "
        "than its prompt kept (default: off)",
    )
    group.add_argument(
        "--decode-window", type=int, help="answer tokens that vote while decoding (default 16)"
    )


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
    """The press the flags name, else the config's default press."""
    name = args.default_press or config.default_press
    if name == "full":
        return make_press("full")
    if args.budget is not None and args.budget < 1:
        raise ConfigError(f"--budget must be positive, got {args.budget}", field="budget")
    press = make_press(name, budget=args.budget, ratio=args.ratio, **press_tuning_from_args(args))
    return without_propagation(press) if config.full_prefill else press


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
