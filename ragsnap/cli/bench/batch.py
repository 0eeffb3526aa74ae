"""``ragsnap bench batch``: aggregate decode throughput of batched rows, compressed vs full.

For each concurrency ``c``, ``c`` different prompts of ``--context`` tokens are prefilled
(once per press), then decoded together as rows of one batch for ``--decode-tokens``
steps (stop tokens ignored). Reported per concurrency and cache kind: aggregate tokens/s,
per-request ms/token, the ratio to a single stream measured in the same run, and the KV
bytes the rows hold at the end (peak).

``--gap-chunks 64,128`` also measures what a prefill does to running streams: with the
largest concurrency's compressed rows decoding, a new ``--context`` prompt prefills in
chunks of each size with a decode step between chunks (as the scheduler does); reported
are the p50/p95 gaps between tokens during that prefill against the gaps with nothing
prefilling, and the prefill's wall time (the new request's first token, steps included).

and the same with each chunk computed in the rows' decode pass instead of beside it
(``riding``, as the scheduler does where the lean pass allows).

``--compare-pass`` also times the compressed rows' decode steps with the lean Llama pass
(:mod:`ragsnap.runtime.llama_pass`) and through transformers' module tree, alternating.

``--compare-tails`` (two or more ``--threads``) also times finishing ``c`` prefix hits
together (each prompt's first ``--context`` tokens cached, a 40-token question tail to
prefill, draft and compress, as a new question over seen documents is): the rows
compressed in turn, and side by side on one worker thread per core (as the server does),
alternating.

``--compare-lanes`` also times decode steps of mixed rows (every fourth a full cache, the
rest compressed) in lanes of like widths and in one buffer padded to the longest row
(:mod:`ragsnap.runtime.decode`), alternating, with the buffer bytes of each.

``--compare-linears`` (CPU) also times the compressed rows' decode steps with the packed
linears the model loads with (oneDNN bfloat16, or fbgemm half-precision weights for
float32) and with plain dense ones, alternating between the two layouts on the same rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ragsnap.cli.bench.decode import prompt_of_length
from ragsnap.cli.options import add_dtype_option
from ragsnap.errors import ConfigError
from ragsnap.runtime.generation import GenerationConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--concurrency", default="1,2,4,8", help="comma-separated row counts")
    parser.add_argument("--context", type=int, default=2048, help="prompt tokens per request")
    parser.add_argument("--budget", type=int, default=256, help="tokens kept per KV head")
    parser.add_argument("--press", default="ragsnap", help="the compressing press")
    parser.add_argument("--decode-tokens", type=int, default=32, help="steps timed per run")
    parser.add_argument("--repeats", type=int, default=2, help="runs per point (median)")
    parser.add_argument("--model", default="embedded")
    add_dtype_option(parser)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--gap-chunks", default="", help="prefill chunk sizes to measure gaps at")
    parser.add_argument(
        "--compare-linears",
        action="store_true",
        help="also time decode with packed vs dense linears (CPU)",
    )
    parser.add_argument(
        "--compare-pass",
        action="store_true",
        help="also time decode with the lean Llama pass vs transformers' module tree",
    )
    parser.add_argument(
        "--compare-lanes",
        action="store_true",
        help="also time mixed full and compressed rows in lanes vs in one padded buffer",
    )
    parser.add_argument(
        "--compare-tails",
        action="store_true",
        help="also time prefix hits finished together, rows compressed in turn vs side by side",
    )
    parser.add_argument("--json", action="store_true", help="print JSON")


def timed_batch(runtime: Any, prefills: list[Any], steps: int) -> tuple[float, int]:
    """Seconds for ``steps`` batched decode steps of ``prefills``, and the KV bytes held."""
    batch = runtime.decode_batch(stop_ids=set())
    for i, p in enumerate(prefills):
        batch.add(i, p, GenerationConfig(max_new_tokens=steps + 2))
    batch.step()  # the first call allocates: not timed
    started = time.perf_counter()
    for _ in range(steps):
        batch.step()
    return time.perf_counter() - started, batch.kv_bytes()


def _quantiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return {"p50_ms": round(1000 * statistics.median(ordered), 2), "p95_ms": round(1000 * p95, 2)}


def token_gaps(
    runtime: Any, rows: list[Any], prompt: list[int], press: Any, chunks: list[int], steps: int
) -> list[dict[str, Any]]:
    """Gaps between decode steps of ``rows``, idle and while ``prompt`` prefills in chunks
    (a decode step between chunks, then each chunk in a decode step's pass)."""
    from ragsnap.runtime.llama_pass import ChunkFeed

    batch = runtime.decode_batch(stop_ids=set())
    for i, p in enumerate(rows):
        # enough for the idle steps and one step per chunk of every prefill below (twice:
        # plain, then riding)
        longest = steps + 4 + 2 * sum(len(prompt) // chunk + 3 for chunk in chunks)
        batch.add(i, p, GenerationConfig(max_new_tokens=longest))
    stamps: list[float] = []

    def step() -> None:
        batch.step()
        stamps.append(time.perf_counter())

    for _ in range(steps + 1):
        step()
    idle = _quantiles([b - a for a, b in zip(stamps, stamps[1:], strict=False)])
    ridden: list[bool] = []

    class Riding:  # the scheduler's on_chunk when the chunk rides the rows' decode pass
        def __call__(self) -> None:
            if not ridden[-1]:
                step()

        def ride(self, ids: list[int], cache: Any, begin: int) -> bool:
            feed = ChunkFeed(ids, cache, begin)
            batch.step(feed)
            stamps.append(time.perf_counter())
            ridden.append(feed.done)
            return feed.done

    def prefilling(chunk: int, riding: bool) -> tuple[float, dict[str, float]]:
        """The prefill's seconds (decode steps included) and the gaps meanwhile."""
        stamps.clear()
        step()
        runtime.chunk = chunk
        began = time.perf_counter()
        runtime.prefill(prompt, press, on_chunk=Riding() if riding else step)
        prefill_s = time.perf_counter() - began
        step()
        return prefill_s, _quantiles([b - a for a, b in zip(stamps, stamps[1:], strict=False)])

    out = []
    for chunk in chunks:
        prefill_s, during = prefilling(chunk, riding=False)
        ridden.clear()
        riding_s, riding_during = prefilling(chunk, riding=True)
        out.append(
            {
                "chunk": chunk,
                "rows": len(rows),
                "idle": idle,
                "while_prefilling": during,
                "prefill_s": round(prefill_s, 2),
                "p95_ratio": round(during["p95_ms"] / idle["p95_ms"], 2),
                # the chunks computed in the rows' decode passes (ChunkFeed), where they can
                "riding": {
                    "chunks_ridden": sum(ridden),
                    "chunks": len(ridden),
                    "while_prefilling": riding_during,
                    "prefill_s": round(riding_s, 2),
                    "prefill_s_over_plain": round(riding_s / prefill_s, 3),
                },
            }
        )
    runtime.chunk = None
    return out


def alternate(
    runtime: Any,
    prefills: list[Any],
    levels: list[int],
    steps: int,
    repeats: int,
    variants: Sequence[tuple[str, Callable[[], object]]],
) -> list[dict[str, Any]]:
    """Per concurrency, ms per decode step (median) under each of two ``variants``
    (``(name, switch to it)``), alternating between them ``repeats`` times."""
    seconds: dict[tuple[str, int], list[float]] = {}
    for _ in range(repeats):
        for name, use in variants:
            use()
            for c in levels:
                elapsed, _ = timed_batch(runtime, prefills[:c], steps)
                seconds.setdefault((name, c), []).append(elapsed / steps)
    (first, _), (second, _) = variants
    rows = []
    for c in levels:
        a, b = (statistics.median(seconds[(name, c)]) for name in (first, second))
        rows.append(
            {
                "concurrency": c,
                f"{first}_ms_per_step": round(1000 * a, 2),
                f"{second}_ms_per_step": round(1000 * b, 2),
                f"{second}_over_{first}": round(b / a, 2),
            }
        )
    return rows


def compare_linears(
    runtime: Any, prefills: list[Any], levels: list[int], steps: int, repeats: int
) -> list[dict[str, Any]]:
    """Per concurrency, ms per decode step with packed and with dense linears (medians)."""
    from ragsnap.runtime.loading.cpu_linears import pack_linears, unpack_linears

    model = runtime.model
    if unpack_linears(model) == 0:
        raise ConfigError(
            "--compare-linears: the model has no packed linears (they are used on CPU only, "
            "where this torch build can pack the model's dtype: --device cpu)"
        )
    variants = [("packed", lambda: pack_linears(model)), ("dense", lambda: unpack_linears(model))]
    try:
        return alternate(runtime, prefills, levels, steps, repeats, variants)
    finally:
        pack_linears(model)


def compare_pass(
    runtime: Any, prefills: list[Any], levels: list[int], steps: int, repeats: int
) -> list[dict[str, Any]]:
    """Per concurrency, ms per decode step with the lean pass and with the module tree."""
    lean = runtime.lean
    if lean is None:
        raise ConfigError("--compare-pass: this model has no lean pass (Llama, Mistral, Qwen2)")

    def use(path: Any) -> Callable[[], None]:
        return lambda: setattr(runtime, "lean", path)

    try:
        return alternate(
            runtime, prefills, levels, steps, repeats, [("lean", use(lean)), ("tree", use(None))]
        )
    finally:
        runtime.lean = lean


def compare_lanes(
    runtime: Any, prefills: dict[str, list[Any]], levels: list[int], steps: int, repeats: int
) -> list[dict[str, Any]]:
    """Per concurrency, ms per decode step of mixed rows (every fourth a full cache) in
    lanes of like widths and in one padded buffer (medians), and each one's buffer bytes."""
    from ragsnap.runtime import decode

    count = max(levels)
    mixed = [prefills["full" if i % 4 == 0 else "compressed"][i] for i in range(count)]
    default = decode.LANE_SHARE

    def use(share: float) -> Callable[[], None]:
        return lambda: setattr(decode, "LANE_SHARE", share)

    variants = [("lanes", use(default)), ("one_buffer", use(0.0))]
    try:
        rows = alternate(runtime, mixed, levels, steps, repeats, variants)
        for row in rows:
            for name, switch in variants:
                switch()
                batch = runtime.decode_batch(stop_ids=set())
                for i, p in enumerate(mixed[: row["concurrency"]]):
                    batch.add(i, p, GenerationConfig(max_new_tokens=steps + 2))
                row[f"{name}_buffer_bytes"] = batch.buffer_bytes()
                row[f"{name}_count"] = len(batch.lanes)
            row["kv_bytes"] = batch.kv_bytes()
        return rows
    finally:
        decode.LANE_SHARE = default


def compare_tails(
    runtime: Any, press: Any, context: int, levels: list[int], repeats: int, threads: int
) -> list[dict[str, Any]]:
    """Per concurrency, seconds to finish that many prefix hits in one group with the rows
    compressed in turn and side by side (medians; the shared passes' part of each)."""
    from ragsnap.compression.words import word_starts
    from ragsnap.runtime import tails as _tails
    from ragsnap.runtime.prefill import drain

    tail_tokens = 40
    prompts = [prompt_of_length(runtime, context + tail_tokens, seed=i) for i in range(max(levels))]
    prefixes = [runtime.prefill_full(p[:context]) for p in prompts]
    words = [word_starts(runtime.tokenizer, p) for p in prompts]
    seconds: dict[tuple[str, int], list[tuple[float, float]]] = {}
    scratch: list[tuple[torch.Tensor, torch.Tensor]] = []  # batch memory, reused
    pool = runtime.row_workers(threads)  # the server's workers
    for _ in range(repeats):
        for name, workers in (("in_turn", None), ("side_by_side", pool)):
            for c in levels:
                tails = [
                    _tails.Tail(p, prefix, context, press, word_starts=starts)
                    for p, prefix, starts in zip(prompts[:c], prefixes[:c], words[:c], strict=True)
                ]
                started = time.perf_counter()
                done = drain(
                    _tails.prefill_tails_steps(
                        runtime.model,
                        runtime.cache_kwarg,
                        tails,
                        runtime.stop_ids,
                        scratch,
                        workers,
                    )
                )
                elapsed = time.perf_counter() - started
                shared = done[0].prefill_s - done[0].compress_s
                seconds.setdefault((name, c), []).append((elapsed, shared))
    rows = []
    for c in levels:
        turn, side = (
            statistics.median(s for s, _ in seconds[(name, c)])
            for name in ("in_turn", "side_by_side")
        )
        rows.append(
            {
                "concurrency": c,
                "shared_s": round(statistics.median(s for _, s in seconds[("in_turn", c)]), 3),
                "in_turn_s": round(turn, 3),
                "side_by_side_s": round(side, 3),
                "side_by_side_over_in_turn": round(side / turn, 2),
            }
        )
    return rows


def measure(
    runtime: Any, args: argparse.Namespace, levels: list[int]
) -> tuple[list[dict[str, Any]], dict[str, list[Any]]]:
    """The throughput rows, and the prefills they decoded by cache kind."""
    from ragsnap.compression import FullPress, make_press

    press = make_press(args.press, budget=args.budget)
    prompts = [prompt_of_length(runtime, args.context, seed=i) for i in range(max(levels))]
    prefills: dict[str, list[Any]] = {"compressed": [], "full": []}
    for prompt in prompts:
        full, compressed = runtime.prefill_many(prompt, [FullPress(), press])
        prefills["full"].append(full)
        prefills["compressed"].append(compressed)
    rows = []
    for kind, cached in prefills.items():
        single_tps = None
        for c in levels:
            runs = [
                timed_batch(runtime, cached[:c], args.decode_tokens) for _ in range(args.repeats)
            ]
            seconds = statistics.median(s for s, _ in runs)
            tps = c * args.decode_tokens / seconds
            single_tps = tps if c == 1 else single_tps
            rows.append(
                {
                    "cache": kind,
                    "concurrency": c,
                    "tokens_per_s": round(tps, 2),
                    "ms_per_token_per_request": round(1000 * seconds / args.decode_tokens, 2),
                    "speedup_vs_single": round(tps / single_tps, 2) if single_tps else None,
                    "kv_bytes_peak": runs[0][1],
                }
            )
    return rows, prefills


def run(args: argparse.Namespace) -> int:
    from ragsnap.engine.loading import plain_runtime
    from ragsnap.engine.options import given_fields

    try:
        levels = sorted({int(c) for c in args.concurrency.split(",")})
    except ValueError:
        raise ConfigError(f"--concurrency: not a list of integers: {args.concurrency!r}") from None
    if levels[0] < 1 or args.decode_tokens < 1 or args.repeats < 1 or args.threads < 1:
        raise ConfigError("--concurrency, --decode-tokens, --repeats and --threads must be >= 1")
    if args.context <= args.budget:
        raise ConfigError(
            f"--context {args.context} must exceed --budget {args.budget}", field="context"
        )
    if args.compare_tails and args.threads < 2:
        raise ConfigError("--compare-tails needs --threads 2 or more", field="threads")
    torch.set_num_threads(args.threads)
    runtime = plain_runtime(**given_fields(args))
    if args.compare_tails:
        from ragsnap.compression import make_press
        from ragsnap.runtime.tails import Tail

        tail_press = make_press(args.press, budget=args.budget)
        if not runtime.tails_batchable([Tail([0, 0], [], 1, tail_press)]):
            raise ConfigError(
                f"--compare-tails: this model finishes prefix hits of {args.press!r} one by "
                "one, not together",
                field="press",
            )
    results, prefills = measure(runtime, args, levels)
    compressed = prefills["compressed"]
    report: dict[str, Any] = {
        "model": runtime.loaded.model_id,
        "device": str(runtime.device),
        "threads": args.threads,
        "context": args.context,
        "budget": args.budget,
        "press": args.press,
        "decode_tokens": args.decode_tokens,
        "results": results,
    }
    if args.gap_chunks:
        from ragsnap.compression import make_press

        press = make_press(args.press, budget=args.budget)
        rows = compressed[: max(levels)]
        fresh = prompt_of_length(runtime, args.context, seed=999)
        chunks = [int(c) for c in args.gap_chunks.split(",")]
        report["gaps"] = token_gaps(runtime, rows, fresh, press, chunks, args.decode_tokens)
    if args.compare_linears:
        report["linears"] = compare_linears(
            runtime, compressed, levels, args.decode_tokens, args.repeats
        )
    if args.compare_pass:
        report["pass"] = compare_pass(runtime, compressed, levels, args.decode_tokens, args.repeats)
    if args.compare_lanes:
        report["lanes"] = compare_lanes(runtime, prefills, levels, args.decode_tokens, args.repeats)
    if args.compare_tails:
        report["tails"] = compare_tails(
            runtime, tail_press, args.context, levels, args.repeats, args.threads
        )
    if (
        args.json
        or args.gap_chunks
        or args.compare_linears
        or args.compare_pass
        or args.compare_lanes
        or args.compare_tails
    ):
        print(json.dumps(report, indent=2))
    else:
        print(
            f"{report['model']} on {report['device']}, {args.threads} thread(s), context {args.context}"
        )
        for r in report["results"]:
            print(
                f"{r['cache']:>10} x{r['concurrency']:<2} {r['tokens_per_s']:>8.1f} tok/s "
                f"{r['ms_per_token_per_request']:>8.1f} ms/token/request "
                f"speedup {r['speedup_vs_single']}  KV {r['kv_bytes_peak'] / 2**20:.1f} MiB"
            )
    return 0
