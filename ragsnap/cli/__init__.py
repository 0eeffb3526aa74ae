"""The ``ragsnap`` command line: one module per subcommand, each with ``register(subparsers)``."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from ragsnap.errors import RagSnapError

# subcommand modules, imported lazily so `ragsnap --help` stays fast
SUBCOMMANDS = ("ask", "bench", "eval", "calibrate", "cache", "serve", "diagnose")


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(
        prog="ragsnap",
        description="Question answering over documents with a query-aware compressed KV cache.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(f"ragsnap.cli.{name}").register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.handler(args) or 0)
    except RagSnapError as exc:
        print(f"ragsnap: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ragsnap: interrupted", file=sys.stderr)
        return 130
