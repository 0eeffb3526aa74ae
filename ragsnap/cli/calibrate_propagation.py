"""``ragsnap calibrate-propagation``: choose query-aware prefill's ``s`` and ``p`` for a model."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from ragsnap.cli.calibrate import add_held_out_arguments, load_held_out
from ragsnap.cli.options import add_model_options


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "calibrate-propagation",
        help="choose the split layer s and propagated share p of query-aware prefill",
        description="On held-out items, measure KL(full || press) for the press on the full "
        "path and propagating at every (s, p) of the grid; choose the cheapest point whose "
        "mean KL is at most --tolerance times the full path's, and write it as JSON "
        "(ragsnap/compression/profiles/propagation/<model>.json is what 'auto' reads). "
        "Calibrate on items you do not evaluate on (--skip).",
    )
    add_held_out_arguments(parser, limit=8)
    parser.add_argument("--press", default="ragsnap-lookahead", help="the press to propagate")
    parser.add_argument("--budget", type=int, default=256, help="tokens kept per KV head")
    parser.add_argument("--layers", default="6,8,10,12", help="comma-separated s to try")
    parser.add_argument("--shares", default="0.2,0.3,0.4", help="comma-separated p to try")
    parser.add_argument("--tolerance", type=float, default=1.25, help="KL ratio allowed")
    parser.add_argument("--max-new-tokens", type=int, default=24, help="answer length")
    parser.add_argument("--out", type=Path, required=True, help="calibration JSON to write")
    add_model_options(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from ragsnap.compression import make_press
    from ragsnap.compression.propagate import without_propagation
    from ragsnap.errors import ConfigError
    from ragsnap.eval.propagation_calibrate import calibrate_propagation

    try:
        layers = [int(x) for x in args.layers.split(",") if x.strip()]
        shares = [float(x) for x in args.shares.split(",") if x.strip()]
    except ValueError:
        raise ConfigError("--layers takes integers, --shares numbers", field="layers") from None
    base = without_propagation(make_press(args.press, budget=args.budget))
    runtime, items, request = load_held_out(args)
    result = calibrate_propagation(
        runtime,
        items,
        request.generation(),
        base,
        args.press,
        args.budget,
        [(s, p) for s in layers for p in shares],
        tolerance=args.tolerance,
        source="ragsnap " + shlex.join(sys.argv[1:]),
        progress=lambda item: print(f"calibrated {item.id}", file=sys.stderr, flush=True),
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(result.to_json())
    for point in result.sweep:
        print(
            f"s={point['layer']:>2} p={point['share']:.2f} work {point['work']:.2f} "
            f"KL {point['kl']:.4f} ({point['kl_ratio']:.2f}x full path) "
            f"prefill {point['prefill_s']:.2f} s"
        )
    print(
        f"full path KL {result.base_kl:.4f}; chosen s={result.layer} p={result.share} "
        f"(KL {result.kl:.4f}) -> {args.out}"
    )
    return 0
