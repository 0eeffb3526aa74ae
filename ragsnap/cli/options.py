"""Command-line options shared by several subcommands."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any

from ragsnap.compression import DEFAULT_PRESS, PRESSES, Press, make_press
from ragsnap.compression.propagate import without_propagation
from ragsnap.errors import ConfigError
from ragsnap.generation import MAX_TEMPERATURE, SEED_MAX, SEED_MIN, GenerationConfig
from ragsnap.models import MATMUL_PRECISIONS
from ragsnap.prompt import DOCUMENT_ORDERS
from ragsnap.runtime.drafts import DEFAULT_SPECULATE

if TYPE_CHECKING:
    from ragsnap.cache.store import KVStore


STORAGE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8")


def number_in(low: float, high: float, *, low_open: bool = False) -> Any:
    """An argparse ``type``: a finite float in ``[low, high]`` (``(low, high]`` with
    ``low_open``), refused while the command line is parsed (before any model loads)."""
    import math

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
    parser.add_argument(
        "--model",
        default="embedded",
        help="'embedded' (SmolLM2-135M-Instruct, bundled), a Hugging Face id, a directory or a .gguf file",
    )
    parser.add_argument(
        "--device", default="auto", help="auto (cuda when available), cpu, cuda, cuda:1..."
    )
    add_dtype_option(parser)


def add_dtype_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dtype",
        default=os.environ.get("RAGSNAP_DTYPE", "auto"),
        help="compute dtype: auto (bfloat16 on CUDA and on CPUs with AMX, else float32), "
        "float32, bfloat16 ($RAGSNAP_DTYPE)",
    )
    parser.add_argument(
        "--matmul-precision",
        default=os.environ.get("RAGSNAP_MATMUL_PRECISION", "auto"),
        choices=MATMUL_PRECISIONS,
        help="float32 CPU models: medium rounds the inputs of long products (prefill "
        "linears and attention) to bfloat16, float32 accumulation; auto: medium on CPUs "
        "with AVX512-BF16, else highest ($RAGSNAP_MATMUL_PRECISION)",
    )


def add_press_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("compression")
    group.add_argument("--press", default=DEFAULT_PRESS, help=f"one of: {', '.join(PRESSES)}")
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
    group.add_argument(
        "--full-prefill",
        action="store_true",
        default=None,
        help="force the full prefill path: a press that propagates runs without it "
        "($RAGSNAP_FULL_PREFILL=1)",
    )
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


def full_prefill_forced(flag: bool | None = None) -> bool:
    """Whether the full prefill path is forced: ``--full-prefill`` (``flag``), else
    ``$RAGSNAP_FULL_PREFILL`` (1/true/yes/on)."""
    if flag:
        return True
    return os.environ.get("RAGSNAP_FULL_PREFILL", "").strip().lower() in ("1", "true", "yes", "on")


def add_document_order_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--document-order",
        choices=DOCUMENT_ORDERS,
        default="relevance",
        help="relevance: by BM25 relevance to the question, the most relevant last (default); "
        "given: as listed (the same document prefix for every question)",
    )


def add_generation_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("generation")
    group.add_argument("--max-new-tokens", type=int, default=128, help="longest answer, in tokens")
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
    group.add_argument(
        "--speculate",
        type=int,
        default=DEFAULT_SPECULATE,
        help="drafted tokens a greedy answer feeds per decode step, checked in the same "
        f"pass (default {DEFAULT_SPECULATE}; 0: off; the answer is the same)",
    )
    group.add_argument(
        "--speculate-ngrams",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also draft what followed the answer's last tokens in the prompt or the answer "
        "(default on)",
    )


def press_from_args(args: argparse.Namespace) -> Press:
    options = {"budget": args.budget, "ratio": args.ratio, **press_tuning_from_args(args)}
    if args.press == "full":
        return make_press("full")
    if args.budget is not None and args.budget < 1:
        raise ConfigError(f"--budget must be positive, got {args.budget}", field="budget")
    press = make_press(args.press, **options)
    if full_prefill_forced(getattr(args, "full_prefill", None)):
        return without_propagation(press)
    return press


def generation_from_args(args: argparse.Namespace) -> GenerationConfig:
    if not 0 <= args.speculate <= 16:
        raise ConfigError(f"--speculate must be 0-16, got {args.speculate}", field="speculate")
    return GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        stop=tuple(getattr(args, "stop", ())),
    )


def add_cache_options(parser: argparse.ArgumentParser, *, prefix_flag: bool = True) -> None:
    group = parser.add_argument_group("cache")
    group.add_argument(
        "--cache",
        metavar="URL|none",
        help="KV store: redis://..., rediss://..., unix://..., file://DIR or none "
        "(default: $RAGSNAP_CACHE_URL, else a file store under the user cache directory)",
    )
    group.add_argument("--namespace", default="default", help="cache namespace (tenant)")
    if prefix_flag:
        group.add_argument(
            "--prefix-cache",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="also keep the full KV of the document prefix, so a new question over the "
            "same documents prefills only its own tokens",
        )
        group.add_argument(
            "--document-cache",
            action=argparse.BooleanOptionalAction,
            default=False,
            help="also keep each document's KV, reused (approximately: re-encoded, a share "
            "recomputed) in new combinations and orders",
        )
        group.add_argument(
            "--recompute-share",
            type=number_in(0.0, 1.0),
            default=float(os.environ.get("RAGSNAP_REUSE_RECOMPUTE", "0.15")),
            metavar="S",
            help="share of reused document tokens recomputed with the full context "
            "(0: plain concatenation, 1: as a cold prefill; default $RAGSNAP_REUSE_RECOMPUTE "
            "or 0.15)",
        )
        group.add_argument(
            "--storage-dtype",
            choices=STORAGE_DTYPES,
            default=os.environ.get("RAGSNAP_STORAGE_DTYPE", "auto"),
            help="dtype of stored KV entries: auto (the model's), bfloat16, float16, or int8 "
            "(one float32 scale per head and token: a quarter of float32's bytes; "
            "$RAGSNAP_STORAGE_DTYPE)",
        )


def open_store_from_args(args: argparse.Namespace) -> KVStore:
    from ragsnap.cache import open_store

    return open_store(args.cache)
