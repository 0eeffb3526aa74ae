"""``ragsnap eval compare RUN_A RUN_B``: two eval output folders, paired, side by side.

Registered under ``ragsnap eval`` as an optional sub-command, so every
``ragsnap eval --format ...`` line keeps working.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def register_compare(eval_parser: argparse.ArgumentParser) -> None:
    commands = eval_parser.add_subparsers(
        dest="eval_command",
        required=False,
        metavar="compare",
        title="sub-command",
        description="'ragsnap eval compare RUN_A RUN_B' compares two --out folders",
    )
    parser = commands.add_parser(
        "compare",
        help="compare two eval output folders (paired by item and press x budget)",
        description="Pair the items of two 'ragsnap eval' output folders by id and press x "
        "budget; print per-metric means, the paired delta (B - A) with a bootstrap 95% "
        "interval over items, the exact sign test, and the settings that differ.",
    )
    parser.add_argument("run_a", type=Path, metavar="RUN_A", help="first --out folder")
    parser.add_argument("run_b", type=Path, metavar="RUN_B", help="second --out folder")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=run_compare)


def run_compare(args: argparse.Namespace) -> int:
    from ragsnap.eval.compare import compare_runs, format_comparison

    result = compare_runs(args.run_a, args.run_b)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print("\n".join(format_comparison(result)))
    return 0
