"""``ragsnap calibrate``: measure a model's per-layer sensitivity, for profiled layer budgets;
``ragsnap calibrate TOOL ...``: the one entrance to the other calibration and measurement
tools (the grounded verdict's rule, citation attribution, the labelled claims), whose
arguments pass through to the tool unchanged."""

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
    add_held_out_arguments(parser, limit=10, required=False)
    parser.add_argument("--budget", type=int, default=128, help="tokens kept per KV head")
    parser.add_argument("--max-new-tokens", type=int, default=24, help="answer length")
    parser.add_argument("--out", type=Path, help="profile JSON to write or extend (required)")
    add_model_options(parser)
    parser.set_defaults(handler=run, tool=None)
    add_tools(parser)


# ``ragsnap calibrate TOOL ARGS...`` runs ``main(ARGS)`` of the module (each also runs as
# ``python -m MODULE``); issue 55: one documented entrance instead of loose entry points
TOOLS = {
    "grounding-eval": (
        "ragsnap.eval.grounding_eval",
        "grounded against correct: the verdict on answerable and unanswerable items (rows)",
    ),
    "grounding-features": (
        "ragsnap.eval.grounding_features",
        "measure the verdict's features again on recorded rows, without the model",
    ),
    "grounding-rule": (
        "ragsnap.eval.grounding_calibrate",
        "fit the grounded verdict's rule on held-out rows; write the model's profile",
    ),
    "grounding-consistency": (
        "ragsnap.eval.consistency_calibrate",
        "choose how the verdict holds to its evidence on held-out rows (issue 53)",
    ),
    "world-knowledge": (
        "ragsnap.eval.world_knowledge",
        "common-knowledge questions over documents without their answers: none grounded",
    ),
    "citations": (
        "ragsnap.eval.citation_calibration",
        "fit how citation attribution's evidence combines, on held-out eval records",
    ),
    "claim-labels": (
        "ragsnap.eval.claim_labels",
        "unsupported-sentence precision and recall on the hand-labelled set",
    ),
}


def add_tools(parser: argparse.ArgumentParser) -> None:
    """``TOOL ARGS...`` after ``calibrate``: the tool's own parser reads ARGS (``--help`` too)."""
    tools = parser.add_subparsers(
        dest="tool",
        metavar="TOOL",
        parser_class=argparse.ArgumentParser,
        title="other calibration tools (ragsnap calibrate TOOL --help for each)",
    )
    for name, (_, help_) in TOOLS.items():
        # "+" as the prefix: every "-x" / "--x" is left for the tool's own parser
        tool = tools.add_parser(name, help=help_, add_help=False, prefix_chars="+")
        tool.add_argument("tool_args", nargs=argparse.REMAINDER)


def run_tool(args: argparse.Namespace) -> int:
    import importlib

    module = importlib.import_module(TOOLS[args.tool][0])
    saved, sys.argv = sys.argv, [f"ragsnap calibrate {args.tool}", *args.tool_args]
    try:  # the tool's usage line names this entrance (argparse reads sys.argv[0])
        return int(module.main(list(args.tool_args)) or 0)
    finally:
        sys.argv = saved


def add_held_out_arguments(
    parser: argparse.ArgumentParser, limit: int, required: bool = True
) -> None:
    """The options that choose calibration items (shared by the calibrate commands)."""
    parser.add_argument(
        "--data",
        type=Path,
        required=required,
        help="data file or folder" + ("" if required else " (required)"),
    )
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
    from ragsnap.errors import ConfigError
    from ragsnap.eval.calibrate import calibrate_layers

    if args.tool is not None:
        return run_tool(args)
    if args.data is None or args.out is None:
        raise ConfigError("calibrate needs --data and --out (or a TOOL)", field="data")
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
