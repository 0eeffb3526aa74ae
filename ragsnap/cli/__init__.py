"""The ``ragsnap`` command line: one module per subcommand, each with ``register(subparsers)``.

Every parser (subcommands included) shows its defaults in ``--help`` and takes the common
options ``-v/--verbose`` and ``--threads`` wherever they appear on the line.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from ragsnap.errors import RagSnapError

# subcommand modules, imported lazily so `ragsnap --help` stays fast
SUBCOMMANDS = (
    "ask",
    "bench",
    "eval",
    "calibrate",
    "calibrate_propagation",
    "cache",
    "serve",
    "diagnose",
)


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: X)`` where there is a default the help does not already state."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default is None or action.default is False or "default" in text:
            return text
        return super()._get_help_string(action)


class RagSnapParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that shows defaults and takes the common options.

    The common options default to ``SUPPRESS``, so a value given before the subcommand is
    not overwritten by the subcommand parser's default (``-v ask`` and ``ask -v`` agree).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        # a command may define its own --threads (a benchmark's fixed default): it wins
        kwargs.setdefault("conflict_handler", "resolve")
        super().__init__(*args, **kwargs)
        common = self.add_argument_group("common options")
        common.add_argument(
            "-v",
            "--verbose",
            action="store_true",
            default=argparse.SUPPRESS,
            help="log progress to stderr",
        )
        common.add_argument(
            "--threads",
            type=int,
            default=argparse.SUPPRESS,
            help="torch CPU threads (default: $OMP_NUM_THREADS, else 1 on <= 2 cores, "
            "else half the cores)",
        )


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        return package_version("ragsnap")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = RagSnapParser(
        prog="ragsnap",
        description="Question answering over documents with a query-aware compressed KV cache.",
    )
    parser.add_argument("--version", action="version", version=f"ragsnap {version()}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(f"ragsnap.cli.{name}").register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from ragsnap.cli.progress import configure_threads

    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = ["ragsnap", *(sys.argv[1:] if argv is None else argv)]  # for provenance
    verbose = getattr(args, "verbose", False)
    args.verbose = verbose
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        args.threads = configure_threads(getattr(args, "threads", None))
        return int(args.handler(args) or 0)
    except RagSnapError as exc:
        print(f"ragsnap: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ragsnap: interrupted", file=sys.stderr)
        return 130
