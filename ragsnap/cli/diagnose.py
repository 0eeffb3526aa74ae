"""``ragsnap diagnose``: a heatmap of how much of a known answer span each layer and head kept."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ragsnap.cli.options import add_model_options
from ragsnap.cli.progress import loading_model


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "diagnose", help="answer-span retention per layer and KV head, for several presses (PNG)"
    )
    parser.add_argument("--question", "-q", required=True)
    parser.add_argument("--docs", nargs="+", required=True, metavar="PATH")
    parser.add_argument("--answer", required=True, help="text that occurs in the documents")
    parser.add_argument(
        "--press",
        default="snapkv,wordspan,attnmatch,ragsnap",
        help="comma-separated presses to compare",
    )
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("span_retention.png"))
    add_model_options(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from ragsnap.compression import make_press
    from ragsnap.engine.loading import load_runtime
    from ragsnap.engine.options import config_from_args
    from ragsnap.eval.diagnostics import diagnose, plot_retention
    from ragsnap.prompt.documents import load_documents

    documents = load_documents(args.docs)
    presses = [make_press(name.strip(), budget=args.budget) for name in args.press.split(",")]
    config = config_from_args(args)
    with loading_model(config.model, config.device):
        runtime = load_runtime(config)
    positions, diagnoses = diagnose(runtime, args.question, documents, args.answer, presses)
    plot_retention(diagnoses, args.answer, args.out)
    print(
        json.dumps(
            {
                "answer_tokens": len(positions),
                "budget": args.budget,
                "presses": [d.summary() for d in diagnoses],
                "png": str(args.out),
            },
            indent=2,
        )
    )
    return 0
