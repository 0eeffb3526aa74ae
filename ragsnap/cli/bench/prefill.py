"""``ragsnap bench prefill``: what each press costs a cold prefill, side by side.

For each context length, the presses prefill the same prompt in turn (the order rotates
with each repetition, so machine noise hits them alike) and the medians are reported, with
each press's median ratio to the first one measured on the same repetitions, and how many
answer tokens a press that looks ahead drafted (``ragsnap-lookahead``).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from typing import Any

import torch

from ragsnap.cli.bench.decode import layout_of_length, parse_contexts
from ragsnap.cli.options import add_dtype_option
from ragsnap.cli.progress import loading_model
from ragsnap.errors import ConfigError

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--context", required=True, metavar="N[,N...]", help="prompt lengths in tokens"
    )
    parser.add_argument(
        "--press",
        default="ragsnap,ragsnap-lookahead",
        help="comma-separated presses; ratios are to the first (default ragsnap,ragsnap-lookahead)",
    )
    parser.add_argument("--budget", type=int, default=512, help="tokens kept per KV head")
    parser.add_argument(
        "--propagate-layer",
        type=int,
        help="s of the presses that propagate (ragsnap-propagate): layers 1..s see every token",
    )
    parser.add_argument(
        "--propagate-share",
        type=float,
        help="p of the presses that propagate: the share of tokens past layer s, in (0, 1]",
    )
    parser.add_argument(
        "--full-prefill",
        action="store_true",
        help="force the full prefill path (presses that propagate run without it)",
    )
    parser.add_argument(
        "--model", default="embedded", help="'embedded', a Hugging Face id or a path"
    )
    add_dtype_option(parser)
    parser.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda...")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions; medians are reported")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def measure(
    runtime: Any, presses: dict[str, Any], contexts: list[int], repeats: int
) -> list[dict[str, Any]]:
    """Per context: median prefill seconds per press, median ratio to the first press, and
    the tokens each press drafted (the last repetition's). Prompts are prefilled as the
    engine prefills them (:meth:`~ragsnap.runtime.model_runtime.ModelRuntime.prefill_prompt`)."""
    names = list(presses)
    layouts = {n: layout_of_length(runtime, n) for n in contexts}

    def prefill(n: int, name: str) -> Any:
        return runtime.prefill_prompt(layouts[n], presses[name])

    prefill(contexts[0], names[0])  # warm-up
    rows = []
    for n in contexts:
        seconds: dict[str, list[float]] = {name: [] for name in names}
        drafted: dict[str, int] = {}
        paths: dict[str, Any] = {}
        for rep in range(repeats):
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                started = time.perf_counter()
                result = prefill(n, name)
                seconds[name].append(time.perf_counter() - started)
                drafted[name] = result.drafted_tokens
                paths[name] = {
                    "path": result.prefill_path,
                    "layer": result.propagate_layer,
                    "propagated_tokens": result.propagated_tokens,
                }
            logger.info("context %d, repetition %d/%d", n, rep + 1, repeats)
        first = seconds[names[0]]
        rows.append(
            {
                "context": n,
                "prefill_s": {name: round(statistics.median(s), 4) for name, s in seconds.items()},
                "ratio_to_first": {
                    name: round(statistics.median(a / b for a, b in zip(s, first, strict=True)), 3)
                    for name, s in seconds.items()
                },
                "drafted_tokens": drafted,
                "prefill_path": paths,
            }
        )
    return rows


def _press(name: str, args: argparse.Namespace) -> Any:
    """Press ``name`` at ``--budget``; a press that propagates takes ``--propagate-layer``
    and ``--propagate-share``, or loses its propagation under ``--full-prefill``."""
    from ragsnap.compression import make_press
    from ragsnap.compression.propagate import propagation_of, without_propagation

    press = make_press(name, budget=args.budget)
    if propagation_of(press) is None:
        return press
    if args.full_prefill:
        return without_propagation(press)
    layer, share = args.propagate_layer, args.propagate_share
    if layer is None and share is None:
        return press
    return make_press(name, budget=args.budget, propagate_layer=layer, propagate_share=share)


def run(args: argparse.Namespace) -> int:
    from ragsnap.engine.loading import plain_runtime
    from ragsnap.engine.options import given_fields

    if args.repeats < 1:
        raise ConfigError("--repeats must be at least 1", field="repeats")
    if args.budget < 1:
        raise ConfigError(f"--budget must be positive, got {args.budget}", field="budget")
    contexts = parse_contexts(args.context, args.budget)
    names = [name.strip() for name in args.press.split(",") if name.strip()]
    if not names:
        raise ConfigError("--press is empty", field="press")
    presses = {name: _press(name, args) for name in dict.fromkeys(names)}
    with loading_model(args.model, args.device):
        runtime = plain_runtime(**given_fields(args))
    rows = measure(runtime, presses, contexts, args.repeats)
    report = {
        "model": runtime.loaded.model_id,
        "device": str(runtime.device),
        "threads": torch.get_num_threads(),
        "budget": args.budget,
        "results": rows,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for row in rows:
            cells = ", ".join(
                f"{name} {row['prefill_s'][name]:.3f} s ({row['ratio_to_first'][name]:.2f}x)"
                for name in presses
            )
            print(f"context {row['context']}: {cells}")
    return 0
