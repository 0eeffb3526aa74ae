"""``ragsnap bench <what>``: benchmark commands that print a table or JSON.

Each benchmark lives in ``ragsnap/cli/bench/<what>.py`` with ``add_arguments(parser)`` and
``run(args) -> int``; the modules import their heavy dependencies only when run.
"""

from __future__ import annotations

import argparse
import importlib

BENCHMARKS = {
    "decode": "prefill, compression and decode speed: full cache vs compressed vs a short-prompt floor",
    "prefill": "cold prefill seconds of several presses on the same prompts, as ratios to the first",
    "cache": "time to first token for a cache miss, a full hit and a document-prefix hit",
    "load": "concurrent clients against a running ragsnap server",
    "speculate": "decode tokens/s of real RAG answers with drafted tokens vs plain decoding",
    "batch": "aggregate decode tokens/s of batched requests, compressed vs full caches",
    "peer": "ragsnap serve against vLLM on the same RAG requests: answers/s, TTFT, agreement",
    "overhead": "Ray Serve's added latency per request and per streamed token vs in-process",
    "reuse": "per-document KV reuse in new combinations and orders vs cold prefills, per recompute share",
    "fairness": "a small request's wait behind a long prompt, for several long-prompt lengths",
    "storage": "stored entry bytes, hit load time and KL to the full cache per storage dtype",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="benchmarks (print a table, or JSON with --json)")
    kinds = parser.add_subparsers(dest="benchmark", required=True)
    for name, help_text in BENCHMARKS.items():
        sub = kinds.add_parser(name, help=help_text)
        module = importlib.import_module(f"ragsnap.cli.bench.{name}")
        module.add_arguments(sub)
        sub.set_defaults(handler=module.run)
