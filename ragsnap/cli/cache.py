"""``ragsnap cache stats|clear``: look at or empty the compressed-KV store."""

from __future__ import annotations

import argparse
import json

from ragsnap.cli.options import add_cache_options, open_store_from_args


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("cache", help="inspect or clear the compressed-KV cache")
    actions = parser.add_subparsers(dest="cache_action", required=True)
    stats = actions.add_parser(
        "stats", help="entries and bytes held (of one namespace with --namespace)"
    )
    add_cache_options(stats, prefix_flag=False)
    stats.add_argument("--json", action="store_true", help="print one JSON object")
    stats.set_defaults(handler=run_stats, namespace=None)
    clear = actions.add_parser(
        "clear", help="delete cached entries (of one namespace with --namespace)"
    )
    add_cache_options(clear, prefix_flag=False)
    clear.set_defaults(handler=run_clear, namespace=None)


def run_stats(args: argparse.Namespace) -> int:
    with open_store_from_args(args) as store:
        stats = store.stats(args.namespace)
    if args.json:
        print(json.dumps(stats, indent=2))
        return 0
    for name, value in stats.items():
        print(f"{name}: {value}")
    return 0


def run_clear(args: argparse.Namespace) -> int:
    from ragsnap.cache import StoreUnavailable
    from ragsnap.errors import ConfigError

    with open_store_from_args(args) as store:
        try:
            removed = store.clear(args.namespace)
        except StoreUnavailable as exc:
            raise ConfigError(f"the cache at {store.describe()} is unreachable: {exc}") from exc
        where = f"namespace {args.namespace!r}" if args.namespace else "all namespaces"
        print(f"removed {removed} entries from {store.describe()} ({where})")
    return 0
