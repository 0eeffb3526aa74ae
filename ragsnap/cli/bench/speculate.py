"""``ragsnap bench speculate``: decode speed with drafted tokens, against plain decoding.

Real RAG prompts (a data set in ``../shared/data`` layout, built as ``bench peer`` builds
them: the data set's questions and open "what do the documents say about X" questions over
the same documents) are prefilled once with the press. Then, for each concurrency ``c``,
every prompt's answer is decoded greedily in batches of ``c`` rows, once per mode in
``--speculate``: ``0`` is plain decoding, ``K`` feeds up to ``K`` of the tokens the
lookahead press drafted, ``K+ngrams`` prompt n-grams too (:mod:`ragsnap.runtime.drafts`);
the modes take turns within each repetition so machine noise hits them alike.
Reported per ``c`` and mode (medians
over repetitions): decode tokens/s, answer tokens per model pass, the share of drafted
tokens kept, the speed-up over plain decoding in the same repetitions, and the share of
answers identical to plain decoding's (greedy: they should all be).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ragsnap.cli.options import add_dtype_option
from ragsnap.cli.progress import loading_model
from ragsnap.compression import DEFAULT_PRESS
from ragsnap.errors import ConfigError

logger = logging.getLogger(__name__)


class Prepared(NamedTuple):
    """A workload prompt after its prefill: what a decode row needs."""

    layout: Any
    prefill: Any
    generation: Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", type=Path, required=True, help="data set file or folder")
    parser.add_argument(
        "--format", default="hotpotqa", choices=("hotpotqa", "bioasq", "jsonl", "niah")
    )
    parser.add_argument("--prompts", type=int, default=8, help="data set items (two prompts each)")
    parser.add_argument(
        "--context-tokens", type=int, default=2048, help="document tokens per prompt"
    )
    parser.add_argument("--concurrency", default="1,4,8", help="rows decoded together")
    parser.add_argument(
        "--speculate",
        default="0,8,8+ngrams",
        help="modes to compare: 0 (plain decoding), K (up to K drafted tokens a step), K+ngrams",
    )
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--press",
        default=DEFAULT_PRESS,
        help="the press the prompts are prefilled with (a lookahead press drafts tokens)",
    )
    parser.add_argument("--budget", type=int, default=256, help="tokens kept per KV head")
    parser.add_argument("--repeats", type=int, default=2, help="repetitions; medians are reported")
    parser.add_argument("--seed", type=int, default=0, help="which items are drawn")
    parser.add_argument("--model", default="embedded")
    add_dtype_option(parser)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def decode_all(runtime: Any, prepared: list[Any], rows: int, mode: str) -> dict[str, Any]:
    """Decode every prepared answer, ``rows`` at a time, drafting as ``mode`` says."""
    speculate, _, ngrams = mode.partition("+")
    runtime.speculate, runtime.ngrams = int(speculate), bool(ngrams)
    answers: list[list[int]] = []
    seconds = 0.0
    passes = proposed = accepted = 0
    for start in range(0, len(prepared), rows):
        batch = runtime.decode_batch()
        group = [
            batch.add(i, p.prefill, p.generation, context=p.layout.input_ids)
            for i, p in enumerate(prepared[start : start + rows])
        ]
        began = time.perf_counter()
        while len(batch):
            batch.step()
            passes += 1
        seconds += time.perf_counter() - began
        answers += [row.tokens for row in group]
        proposed += sum(row.proposed for row in group)
        accepted += sum(row.accepted for row in group)
    tokens = sum(len(a) for a in answers)
    return {
        "answers": answers,
        "seconds": seconds,
        "tokens": tokens,
        "passes": passes,
        "proposed": proposed,
        "accepted": accepted,
    }


def measure(
    runtime: Any, prepared: list[Any], levels: list[int], modes: list[str], repeats: int
) -> list[dict[str, Any]]:
    """The JSON rows: per concurrency and mode, medians over ``repeats`` (speed-ups are to
    the first mode)."""
    out = []
    for c in levels:
        runs: dict[str, list[dict[str, Any]]] = {k: [] for k in modes}
        for rep in range(repeats):
            for k in modes[rep % len(modes) :] + modes[: rep % len(modes)]:
                runs[k].append(decode_all(runtime, prepared, c, k))
            logger.info("concurrency %d, repetition %d/%d", c, rep + 1, repeats)
        base = runs[modes[0]]
        for k in modes:
            tps = [r["tokens"] / r["seconds"] for r in runs[k]]
            same = [a == b for a, b in zip(runs[k][0]["answers"], base[0]["answers"], strict=True)]
            last = runs[k][-1]
            out.append(
                {
                    "concurrency": c,
                    "speculate": k,
                    "tokens_per_s": round(statistics.median(tps), 2),
                    "speedup": round(
                        statistics.median(
                            a["seconds"] / b["seconds"] for a, b in zip(base, runs[k], strict=True)
                        ),
                        3,
                    ),
                    "tokens_per_pass": round(last["tokens"] / max(1, last["passes"]), 3),
                    "kept_share": (
                        round(last["accepted"] / last["proposed"], 3) if last["proposed"] else None
                    ),
                    "same_answer": round(sum(same) / len(same), 3),
                }
            )
    return out


def prepare(runtime: Any, args: argparse.Namespace) -> list[Prepared]:
    """Every prompt of the workload, prefilled with the press (no cache), as the engine
    prefills a miss."""
    from ragsnap.cli.bench.peer_workload import build_workload, load_workload_items
    from ragsnap.compression import make_press
    from ragsnap.compression.lookup_focus import uses_focus
    from ragsnap.prompt.focus import prompt_focus
    from ragsnap.prompt.order import fit_prompt
    from ragsnap.prompt.structure import prompt_roles
    from ragsnap.runtime.generation import GenerationConfig

    items = load_workload_items(
        args.format, args.data, args.seed, args.context_tokens, runtime.tokenizer
    )
    try:
        workload = build_workload(
            items,
            runtime.tokenizer,
            levels=[1],
            prompts=args.prompts,
            context_tokens=args.context_tokens,
            max_prompt_tokens=runtime.loaded.context_length - args.max_new_tokens,
        )[1]
    except ValueError as exc:
        raise ConfigError(f"--prompts: {exc}", field="prompts") from None
    press = make_press(args.press, budget=args.budget)
    generation = GenerationConfig(max_new_tokens=args.max_new_tokens)
    requests = workload["cold"] + workload["new_question"]
    prepared = []
    for i, request in enumerate(requests):
        layout = fit_prompt(
            runtime.tokenizer,
            runtime.loaded.context_length,
            request.question,
            request.documents,
            args.max_new_tokens,
            "given",
        )
        roles = prompt_roles(runtime.tokenizer, layout)
        focus = prompt_focus(runtime.tokenizer, layout) if uses_focus(press) else None
        prefill = runtime.prefill_prompt(layout, press, roles=roles, focus=focus)
        prepared.append(Prepared(layout, prefill, generation))
        logger.info("prefilled %d/%d", i + 1, len(requests))
    return prepared


def parse_levels(text: str) -> list[int]:
    try:
        values = list(dict.fromkeys(int(v) for v in text.split(",") if v.strip()))
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ConfigError(
            f"--concurrency: integers of at least 1, got {text!r}", field="concurrency"
        )
    return values


def parse_modes(text: str) -> list[str]:
    """``0,8,8+ngrams`` -> the modes, checked (0-16 tokens, optionally ``+ngrams``)."""
    modes = list(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    for mode in modes:
        tokens, plus, ngrams = mode.partition("+")
        if not (tokens.isdigit() and int(tokens) <= 16 and ngrams == ("ngrams" if plus else "")):
            raise ConfigError(
                f"--speculate: {mode!r} is not 0-16 or 0-16+ngrams", field="speculate"
            )
    if not modes:
        raise ConfigError("--speculate is empty", field="speculate")
    return modes


def run(args: argparse.Namespace) -> int:
    from ragsnap.engine.loading import plain_runtime
    from ragsnap.engine.options import given_fields

    levels = parse_levels(args.concurrency)
    modes = parse_modes(args.speculate)
    for name in ("prompts", "repeats", "max_new_tokens", "budget"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1", field=name)
    if not args.data.exists():
        raise ConfigError(f"--data: {args.data} does not exist", field="data")
    with loading_model(args.model, args.device):
        runtime = plain_runtime(**given_fields(args))
    prepared = prepare(runtime, args)
    rows = measure(runtime, prepared, levels, modes, args.repeats)
    report = {
        "model": runtime.loaded.model_id,
        "device": str(runtime.device),
        "dtype": str(next(runtime.loaded.model.parameters()).dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "press": args.press,
        "budget": args.budget,
        "answers": len(prepared),
        "mean_prompt_tokens": round(statistics.fmean(p.layout.num_tokens for p in prepared), 1),
        "results": rows,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for row in rows:
            print(
                f"c={row['concurrency']} speculate={row['speculate']}: "
                f"{row['tokens_per_s']:.1f} tok/s ({row['speedup']:.2f}x), "
                f"{row['tokens_per_pass']:.2f} tokens/pass, kept {row['kept_share']}, "
                f"same answer {row['same_answer']:.2f}"
            )
    return 0
