"""``ragsnap calibrate``: measure a model's per-layer sensitivity, for profiled layer budgets."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

from ragsnap.cli.options import add_model_options
from ragsnap.cli.progress import loading_model


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "calibrate",
        help="measure per-layer sensitivity to compression (a layer-budget profile)",
        description="Compress one layer at a time with SnapKV and measure KL(full || compressed) "
        "along the full cache's answer; write the per-layer means as a profile JSON that "
        "the 'layerbudget' and 'ragsnap' presses read (--profile PATH, or packaged). An "
        "existing --out for the same model and budget is extended, skipping its items. "
        "Calibrate on items you do not evaluate on (--skip).",
    )
    add_held_out_arguments(parser, limit=10)
    parser.add_argument("--budget", type=int, default=128, help="tokens kept per KV head")
    parser.add_argument("--max-new-tokens", type=int, default=24, help="answer length")
    parser.add_argument("--out", type=Path, required=True, help="profile JSON to write or extend")
    add_model_options(parser)
    parser.set_defaults(handler=run)


def add_held_out_arguments(parser: argparse.ArgumentParser, limit: int) -> None:
    """The options that choose calibration items (shared by the calibrate commands)."""
    parser.add_argument("--data", type=Path, required=True, help="data file or folder")
    parser.add_argument("--format", choices=("bioasq", "jsonl", "hotpotqa"))
    parser.add_argument("--types", help="keep only these item types, e.g. factoid")
    parser.add_argument("--context-tokens", type=int, help="BioASQ: pad to about N tokens")
    parser.add_argument("--skip", type=int, default=0, help="leave out the first N items")
    parser.add_argument(
        "--limit", type=int, default=limit, help=f"calibrate on N items (default {limit})"
    )


def load_held_out(args: argparse.Namespace) -> tuple[Any, list[Any], Any]:
    """``(runtime, items, request)``: the model's runtime and the ``--skip``/``--limit``
    items."""
    from ragsnap.engine.loading import load_runtime
    from ragsnap.engine.options import config_from_args
    from ragsnap.errors import ConfigError
    from ragsnap.eval.evaluate import EvalRequest, load_request_items

    if args.skip < 0 or args.limit < 1:
        raise ConfigError("--skip must be >= 0 and --limit >= 1", field="limit")
    request = EvalRequest(
        out=args.out.parent,
        data=args.data,
        format=args.format,
        presses=["snapkv"],
        budgets=[args.budget],
        max_new_tokens=args.max_new_tokens,
        context_tokens=args.context_tokens,
        types=[t.strip() for t in args.types.split(",")] if args.types else None,
    )
    request.validate()
    config = config_from_args(args)
    with loading_model(config.model, config.device):
        runtime = load_runtime(config)
    items = load_request_items(runtime, request).items[args.skip : args.skip + args.limit]
    return runtime, items, request


def run(args: argparse.Namespace) -> int:
    from ragsnap.compression.layer_budgets import LayerProfile
    from ragsnap.eval.calibrate import calibrate_layers

    previous = LayerProfile.load(args.out) if args.out.exists() else None
    runtime, items, request = load_held_out(args)
    profile = calibrate_layers(
        runtime,
        items,
        request.generation(),
        args.budget,
        previous=previous,
        source="ragsnap " + shlex.join(sys.argv[1:]),
        progress=lambda item: print(f"calibrated {item.id}", file=sys.stderr, flush=True),
    )
    args.out.write_text(profile.to_json())
    shares = " ".join(f"{s:.2f}" for s in profile.shares())
    print(f"{len(profile.items)} items, {profile.model} -> {args.out}\nlayer shares: {shares}")
    return 0
