"""``ragsnap bench decode``: what compression costs at prefill and buys at decode.

For each context length ``N`` and a budget ``B``, one run measures, interleaved and
repeated (medians reported):

- prefill seconds of the ``N``-token prompt and the compression seconds within it;
- decode ms/token with the full ``N``-entry cache, with the press's ``B``-entry cache, and
  with the cache of a plain ``B``-token prompt (the floor compression can reach);
- the KV bytes of the full and the compressed cache.

One prefill per repetition serves both the full and the compressed cache (the press runs
on a cache that stays full, and the compressed one is derived from it), and the three
decodes advance one step each in turn, so machine noise hits them alike.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ragsnap.cli.options import add_dtype_option
from ragsnap.cli.progress import loading_model
from ragsnap.errors import ConfigError
from ragsnap.runtime.generation import GenerationConfig

logger = logging.getLogger(__name__)

_SUBJECTS = ("The harbour", "A farmer", "The old mill", "Our neighbour", "The library", "A ferry")
_VERBS = ("opened early", "stayed quiet", "looked busy", "was repainted", "needed repairs", "grew")
_ENDINGS = (
    "on Monday.",
    "after the rain.",
    "in spring.",
    "before sunset.",
    "last year.",
    "at dawn.",
)
QUESTION = "Which places in the notes needed repairs, and when?"


@dataclass
class DecodeResult:
    """Medians for one context length (the JSON row of ``ragsnap bench decode``)."""

    context: int
    prefill_s: float
    compress_s: float
    decode_ms_full: float
    decode_ms_compressed: float
    decode_ms_floor: float
    kv_bytes_full: int
    kv_bytes_compressed: int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--context",
        required=True,
        metavar="N[,N...]",
        help="prompt lengths in tokens, e.g. 4096,8192",
    )
    parser.add_argument(
        "--budget",
        type=int,
        default=512,
        help="tokens kept per KV head, window included; also the floor's prompt length",
    )
    parser.add_argument("--press", default="snapkv", help="the press to measure (default snapkv)")
    parser.add_argument("--window", type=int, help="observation window of the press")
    parser.add_argument(
        "--model", default="embedded", help="'embedded', a Hugging Face id or a path"
    )
    add_dtype_option(parser)
    parser.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda...")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions; medians are reported")
    parser.add_argument("--decode-tokens", type=int, default=32, help="decode steps timed per run")
    # --threads is a common option of every ragsnap command (ragsnap.cli)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def parse_contexts(text: str, budget: int) -> list[int]:
    """``"4096,8192"`` -> ``[4096, 8192]``; every length must exceed the budget."""
    try:
        contexts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise ConfigError(
            f"--context must be integers separated by commas, got {text!r}", field="context"
        ) from exc
    if not contexts:
        raise ConfigError("--context is empty", field="context")
    too_short = [n for n in contexts if n <= budget]
    if too_short:
        raise ConfigError(
            f"--context {too_short[0]} is not longer than the budget {budget}: nothing to compress",
            field="context",
        )
    return contexts


def filler_document(tokens: int, seed: int = 0) -> str:
    """Plain prose of at least ``tokens`` tokens for most tokenizers (about 6 tokens a sentence)."""
    rng = random.Random(seed)
    sentences = [
        f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_ENDINGS)}"
        for _ in range(tokens // 3 + 16)
    ]
    return " ".join(sentences)


def prompt_of_length(runtime: Any, length: int, seed: int = 0) -> list[int]:
    """A chat prompt of exactly ``length`` tokens: notes truncated to fit, the question last."""
    return layout_of_length(runtime, length, seed).input_ids


def layout_of_length(runtime: Any, length: int, seed: int = 0) -> Any:
    """The :class:`~ragsnap.prompt.assembly.PromptLayout` of :func:`prompt_of_length`."""
    from ragsnap.prompt.assembly import assemble_prompt
    from ragsnap.prompt.documents import Document

    doc = Document(id="notes", title="Town notes", text=filler_document(length, seed))
    layout = assemble_prompt(runtime.tokenizer, QUESTION, [doc], max_prompt_tokens=length)
    if layout.num_tokens != length:
        raise ConfigError(
            f"cannot build a {length}-token prompt (got {layout.num_tokens})", field="context"
        )
    return layout


def timed_decode(runtime: Any, prefills: list[Any], steps: int) -> list[float]:
    """Greedy-decode ``steps`` tokens from each prefill (a batch of one each), in turn.

    Returns the mean ms/token of each. Stop tokens are ignored: every run does ``steps``.
    """
    batches = []
    for prefill in prefills:
        batch = runtime.decode_batch(stop_ids=set())
        batch.add(0, prefill, GenerationConfig(max_new_tokens=steps + 1))
        batches.append(batch)
    for _ in range(steps):
        for batch in batches:
            batch.step()
    return [1000 * batch.rows[0].decode_s / steps for batch in batches]


def measure(
    runtime: Any, press: Any, contexts: list[int], budget: int, repeats: int, steps: int
) -> list[DecodeResult]:
    """Interleaved repetitions over ``contexts``; medians per context."""
    from ragsnap.compression import FullPress

    prompts = {n: prompt_of_length(runtime, n) for n in contexts}
    floor_prompt = prompt_of_length(runtime, budget)
    # warm-up: first calls allocate and pick kernels
    warm = runtime.prefill(floor_prompt, FullPress())
    timed_decode(runtime, [warm], 2)
    samples: dict[int, list[dict[str, float]]] = {n: [] for n in contexts}
    bytes_seen: dict[int, tuple[int, int]] = {}
    for rep in range(repeats):
        for n in contexts:
            full, compressed = runtime.prefill_many(prompts[n], [FullPress(), press])
            floor = runtime.prefill(floor_prompt, FullPress())
            ms_full, ms_compressed, ms_floor = timed_decode(
                runtime, [full, compressed, floor], steps
            )
            samples[n].append(
                {
                    "prefill_s": full.prefill_s,
                    "compress_s": compressed.compress_s,
                    "decode_ms_full": ms_full,
                    "decode_ms_compressed": ms_compressed,
                    "decode_ms_floor": ms_floor,
                }
            )
            bytes_seen[n] = (full.kv_bytes_kept, compressed.kv_bytes_kept)
            logger.info("context %d, repetition %d/%d: %s", n, rep + 1, repeats, samples[n][-1])
            del full, compressed, floor
    results = []
    for n in contexts:
        medians = {key: statistics.median(s[key] for s in samples[n]) for key in samples[n][0]}
        results.append(
            DecodeResult(
                context=n,
                prefill_s=round(medians["prefill_s"], 4),
                compress_s=round(medians["compress_s"], 5),
                decode_ms_full=round(medians["decode_ms_full"], 3),
                decode_ms_compressed=round(medians["decode_ms_compressed"], 3),
                decode_ms_floor=round(medians["decode_ms_floor"], 3),
                kv_bytes_full=bytes_seen[n][0],
                kv_bytes_compressed=bytes_seen[n][1],
            )
        )
    return results


def format_table(report: dict[str, Any]) -> str:
    header = (
        f"{'context':>8} {'prefill_s':>10} {'compress_s':>11} {'share':>6} {'full ms':>8} "
        f"{'comp ms':>8} {'floor ms':>9} {'comp/floor':>10} {'comp/full':>9} {'KV MiB full':>12} "
        f"{'KV MiB comp':>12}"
    )
    lines = [f"model {report['model']} on {report['device']}, budget {report['budget']}", header]
    for r in report["results"]:
        lines.append(
            f"{r['context']:>8} {r['prefill_s']:>10.3f} {r['compress_s']:>11.4f} "
            f"{r['compress_s'] / r['prefill_s']:>6.1%} {r['decode_ms_full']:>8.2f} "
            f"{r['decode_ms_compressed']:>8.2f} {r['decode_ms_floor']:>9.2f} "
            f"{r['decode_ms_compressed'] / r['decode_ms_floor']:>10.3f} "
            f"{r['decode_ms_compressed'] / r['decode_ms_full']:>9.3f} "
            f"{r['kv_bytes_full'] / 2**20:>12.1f} {r['kv_bytes_compressed'] / 2**20:>12.1f}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from ragsnap.compression import make_press
    from ragsnap.engine.loading import plain_runtime
    from ragsnap.engine.options import given_fields

    if args.budget < 1:
        raise ConfigError(f"--budget must be positive, got {args.budget}", field="budget")
    if args.repeats < 1 or args.decode_tokens < 1:
        raise ConfigError("--repeats and --decode-tokens must be at least 1", field="repeats")
    contexts = parse_contexts(args.context, args.budget)
    if args.press == "full":
        raise ConfigError(
            "--press full keeps everything: choose a compressing press", field="press"
        )
    press = make_press(args.press, budget=args.budget, window=args.window)
    if args.threads is not None:
        if args.threads < 1:
            raise ConfigError("--threads must be at least 1", field="threads")
        torch.set_num_threads(args.threads)
    with loading_model(args.model, args.device):
        runtime = plain_runtime(**given_fields(args))
    longest = max(contexts)
    if longest + args.decode_tokens > runtime.loaded.context_length:
        raise ConfigError(
            f"--context {longest} plus {args.decode_tokens} decode tokens exceeds the model's "
            f"context of {runtime.loaded.context_length}",
            field="context",
        )
    results = measure(runtime, press, contexts, args.budget, args.repeats, args.decode_tokens)
    report = {
        "model": runtime.loaded.model_id,
        "device": str(runtime.device),
        "budget": args.budget,
        "results": [asdict(r) for r in results],
    }
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    return 0
