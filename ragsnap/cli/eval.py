"""``ragsnap eval``: a data set through several presses and budgets, scored, with a report."""

from __future__ import annotations

import argparse
from pathlib import Path

from ragsnap.cli.options import (
    add_document_order_option,
    add_model_options,
    add_press_tuning_options,
    press_tuning_from_args,
)
from ragsnap.cli.progress import loading_model
from ragsnap.engine.options import config_from_args
from ragsnap.errors import InputError


def _ints(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from exc


def _floats(text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from exc


def _names(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def register(subparsers: argparse._SubParsersAction) -> None:
    from ragsnap.compression import PRESSES
    from ragsnap.eval.datasets import FORMATS

    parser = subparsers.add_parser(
        "eval",
        help="evaluate presses and budgets on a data set (BioASQ, JSONL, HotpotQA, needles)",
        description="Run a data set through ragsnap with several presses and budgets (the full "
        "cache is always the reference), score answers, citations and fidelity to the full "
        "cache, and write metrics.json, predictions.jsonl, report.md and plots to --out. "
        "Rerunning with the same --out skips finished items.",
    )
    parser.add_argument(
        "--data", type=Path, help="data file or folder (not needed for --format niah)"
    )
    parser.add_argument(
        "--format",
        choices=FORMATS,
        help="data format (guessed from --data when omitted)",
    )
    group = parser.add_argument_group("compression (each press of the grid)")
    group.add_argument(
        "--press",
        type=_names,
        default=["full", "snapkv"],
        help=f"comma-separated presses (from: {', '.join(PRESSES)}); full is always run",
    )
    size = group.add_mutually_exclusive_group()
    size.add_argument(
        "--budget",
        type=_ints,
        default=[128, 256, 512],
        help="comma-separated budgets, tokens kept per KV head (default 128,256,512)",
    )
    size.add_argument(
        "--ratio",
        type=_floats,
        help="comma-separated shares of the prompt kept per KV head, in (0, 1] (instead of "
        "--budget)",
    )
    add_press_tuning_options(group)  # the same options as `ragsnap ask`
    add_document_order_option(parser)
    parser.add_argument("--limit", type=int, help="evaluate the first N items")
    parser.add_argument(
        "--offset", type=int, default=0, help="skip the first N items (held-out calibration)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed for shuffling, padding and needles"
    )
    parser.add_argument(
        "--max-new-tokens", type=int, help="answer length cap (default 64; 16 for niah)"
    )
    parser.add_argument("--out", type=Path, help="output folder (resumable; required)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    group = parser.add_argument_group("bioasq / jsonl / hotpotqa")
    group.add_argument(
        "--context-tokens",
        type=int,
        help="BioASQ: pad the documents with other questions' passages to about N tokens",
    )
    group.add_argument(
        "--types", type=_names, help="keep only these item types, e.g. factoid or yesno,list"
    )
    group = parser.add_argument_group("structured lookups (--format structured)")
    group.add_argument(
        "--structures",
        type=_names,
        help="nested-json,compact-json,xml,table (default: all); sized by --lengths, "
        "--samples items each",
    )
    group = parser.add_argument_group("needle in a haystack (--format niah)")
    group.add_argument("--haystack", type=Path, help="folder of .txt filler files")
    group.add_argument(
        "--lengths", type=_ints, default=[1000, 2000, 4000], help="prompt lengths in tokens"
    )
    group.add_argument(
        "--depths",
        type=_floats,
        default=[0, 25, 50, 75, 100],
        help="needle depths in percent of the haystack",
    )
    group.add_argument("--samples", type=int, default=1, help="needles per length x depth")
    group.add_argument(
        "--needles", type=Path, help="JSONL of {key, value} needles (default: generated)"
    )
    group.add_argument(
        "--no-answer-prefix",
        action="store_true",
        help="do not pre-fill 'The special magic number for X ... is'",
    )
    add_model_options(parser)
    parser.set_defaults(handler=run)
    from ragsnap.cli.eval_compare import register_compare

    register_compare(parser)


def run(args: argparse.Namespace) -> int:
    from ragsnap.engine.loading import load_runtime
    from ragsnap.eval.evaluate import EvalRequest, evaluate

    if args.out is None:
        raise InputError("ragsnap eval needs --out DIR (or: ragsnap eval compare A B)", field="out")
    config = config_from_args(args)
    request = EvalRequest(
        out=args.out,
        data=args.data,
        format=args.format,
        presses=args.press,
        budgets=args.budget,
        ratios=args.ratio,
        press_options=press_tuning_from_args(args),
        command=getattr(args, "argv", None),
        limit=args.limit,
        offset=args.offset,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        decode_slack=args.decode_slack,
        decode_window=args.decode_window,
        document_order=config.document_order,
        context_tokens=args.context_tokens,
        types=args.types,
        haystack=args.haystack,
        lengths=args.lengths,
        depths=args.depths,
        samples=args.samples,
        needles=args.needles,
        structures=args.structures,
        answer_prefix=not args.no_answer_prefix,
        plots=not args.no_plots,
        progress=not args.no_progress,
    )
    request.validate()  # bad input fails before the model loads: options,
    request.check_data()  # and data that does not parse as the (guessed) format
    with loading_model(config.model, config.device):
        runtime = load_runtime(config)  # what every press runs on: no cache tiers
    result = evaluate(runtime, request)
    print(
        f"evaluated {result.evaluated} items ({result.resumed} already done, "
        f"{result.malformed} malformed skipped) -> {result.out}"
    )
    size_word = "ratio" if request.ratios else "budget"
    for run_ in result.runs:
        m = run_["metrics"]
        head = next(
            (k for k in ("needle_accuracy", "accuracy", "list_f1", "rouge_l") if k in m), None
        )
        score = f"{head} {m[head]:.3f}, " if head else ""
        print(
            f"  {run_['press']:>12} {size_word} {str(run_['budget'] or 'all'):>5}  "
            f"n={run_['n']:<4} "
            f"{score}agreement {m.get('agreement', 0):.3f}, KL {m.get('kl', 0):.4f}"
        )
        cites = [
            f"{name} {m[f'cite_{name}_f1']:.3f}"
            for name in ("markers", "bm25_top2", "attention", "overlap", "combined")
            if m.get(f"cite_{name}_f1") is not None
        ]
        if cites:
            print("      citation F1: " + ", ".join(cites))
    return 0
