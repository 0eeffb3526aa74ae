"""``ragsnap bench reuse``: per-document KV reuse against cold prefills, at several recompute shares.

Evaluation items (HotpotQA, BioASQ factoid: ``--data`` once per data set, formats as
``ragsnap eval`` reads them) become passages of about ``context / docs`` tokens, each with a
needle sentence of its own number (:mod:`ragsnap.cli.bench.reuse_items`). Passages are read
in pools of ``--pool``: prompts of ``docs`` passages go through the cache tiers, which store
each passage's piece. Then each item of the pool is asked once, over a new combination and
order of pool passages (its own among them), cold and through the per-document tier at
each ``--shares`` value, with the same press and budget. Per share: time to first token
against cold (median of per-question ratios), mean teacher-forced KL(cold || reused) along
the cold answer and its ratio to plain concatenation's (share 0), agreement with the cold
greedy answer (exact, and top-1 per position), accuracy against gold and citation F1 as
``ragsnap eval`` scores them with paired bootstrap 95% intervals of (share - cold)
(:mod:`ragsnap.cli.bench.reuse_scores`), and how often a needle in a reused passage is
found, against cold.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from ragsnap.cli.bench.reuse_items import DEFAULT_TYPES, NEEDLE_DIGITS, REUSE_FORMATS
from ragsnap.cli.options import add_dtype_option
from ragsnap.cli.progress import loading_model
from ragsnap.errors import ConfigError
from ragsnap.runtime.blend import DEFAULT_SELECTION, SELECTIONS

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data",
        type=Path,
        action="append",
        required=True,
        help="a data file or folder, once per data set, e.g. "
        "../shared/data/hotpotqa/camera_ready_nd8_dev_sample100.json and "
        "../shared/data/bioasq/Task10BGoldenEnriched",
    )
    parser.add_argument(
        "--format",
        choices=REUSE_FORMATS,
        help="format of every --data (guessed per path when omitted)",
    )
    parser.add_argument(
        "--types",
        default=",".join(DEFAULT_TYPES),
        help="item types to ask (default factoid,short: BioASQ factoid and HotpotQA)",
    )
    parser.add_argument(
        "--skip", type=int, default=0, help="leave out each data set's first N items (held out)"
    )
    parser.add_argument(
        "--needle-every",
        type=int,
        default=2,
        help="every Nth question asks for a passage's needle instead (0: none)",
    )
    parser.add_argument(
        "--needle-digits",
        type=int,
        default=NEEDLE_DIGITS,
        help=f"digits of each passage's needle number (default {NEEDLE_DIGITS})",
    )
    parser.add_argument(
        "--pool", type=int, default=32, help="passages per pool, read before its questions"
    )
    parser.add_argument("--docs", type=int, default=8, help="passages per prompt")
    parser.add_argument("--questions", type=int, default=30, help="questions, one per item")
    parser.add_argument("--context", type=int, default=4096, help="prompt length in tokens")
    parser.add_argument(
        "--shares",
        default="0,0.05,0.15,1",
        help="recompute shares to measure (0: plain concatenation, 1: the cold prefix)",
    )
    parser.add_argument(
        "--select",
        default=DEFAULT_SELECTION,
        help=f"how recomputed tokens are chosen, comma-separated to compare: {', '.join(SELECTIONS)}",
    )
    parser.add_argument("--budget", type=int, default=512, help="tokens kept per KV head")
    parser.add_argument("--press", default="snapkv", help="the press (default snapkv)")
    parser.add_argument("--window", type=int, help="observation window of the press")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--model", default="embedded", help="'embedded', a Hugging Face id or a path"
    )
    parser.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda...")
    add_dtype_option(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def document_reuse(runtime: Any, store: Any, share: float, select: str) -> Any:
    """A :class:`~ragsnap.engine.execute.PlanExecutor` over tiers of its own on ``store``
    that reuse documents only (no prefix entries), recomputing ``share`` of each piece's
    tokens chosen by ``select``."""
    from ragsnap.cache.tiers.cached_prefill import CachedPrefill
    from ragsnap.engine.execute import PlanExecutor

    tiers = CachedPrefill(
        runtime.loaded,
        store,
        runtime.cache_from,
        prefix_cache=False,
        document_cache=True,
        blend_reason=runtime.blend_support(),
    )
    return PlanExecutor(runtime, tiers, share, select)


def _since(started: float) -> float:
    """Seconds since ``started`` (after the device finished its queued work)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - started


def run(args: argparse.Namespace) -> int:  # noqa: PLR0915 - one benchmark, start to end
    from ragsnap.cache import open_store
    from ragsnap.cli.bench.reuse_items import build_passages, load_bench_items
    from ragsnap.cli.bench.reuse_scores import answer_scores, run_summary
    from ragsnap.compression import make_press
    from ragsnap.compression.lookup_focus import uses_focus
    from ragsnap.engine.loading import plain_runtime
    from ragsnap.engine.options import given_fields
    from ragsnap.eval.fidelity import compare, full_reference
    from ragsnap.prompt.assembly import assemble_prompt, encode_user_text
    from ragsnap.prompt.focus import prompt_focus
    from ragsnap.prompt.structure import prompt_roles
    from ragsnap.runtime.generation import GenerationConfig

    shares = sorted({float(s) for s in args.shares.split(",") if s.strip()})
    if not shares or min(shares) < 0 or max(shares) > 1 or args.docs < 2 or args.pool < args.docs:
        raise ConfigError("need shares in [0, 1], --docs >= 2 and --pool >= --docs")
    if args.skip < 0 or args.needle_every < 0 or args.questions < 1:
        raise ConfigError("need --skip >= 0, --needle-every >= 0 and --questions >= 1")
    if not 1 <= args.needle_digits <= 12:
        raise ConfigError("--needle-digits takes 1 to 12", field="needle_digits")
    types = tuple(t.strip() for t in args.types.split(",") if t.strip())
    if not types:
        raise ConfigError("--types names no item type", field="types")
    selects = list(dict.fromkeys(s.strip() for s in args.select.split(",") if s.strip()))
    if not selects or set(selects) - set(SELECTIONS):
        raise ConfigError(f"--select takes {', '.join(SELECTIONS)}", field="select")
    # shares 0 and 1 choose nothing: one variant each; the others once per selection
    variants = [
        (share, select)
        for share in shares
        for select in (selects if 0 < share < 1 else selects[:1])
    ]

    def name(share: float, select: str) -> str:
        return f"{select}@{share}" if len(selects) > 1 and 0 < share < 1 else str(share)

    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    with loading_model(args.model, args.device):
        runtime = plain_runtime(**given_fields(args))
    tokenizer = runtime.tokenizer
    press = make_press(args.press, budget=args.budget, window=args.window)
    generation = GenerationConfig(max_new_tokens=args.max_new_tokens)
    scratch = tempfile.TemporaryDirectory(prefix="ragsnap-bench-reuse-")
    store = open_store(f"file://{scratch.name}")
    # per variant its own tiers (its own unwritten and loaded entries) on the one store
    tiers = {
        name(share, select): document_reuse(runtime, store, share, select)
        for share, select in variants
    }
    stored = next(iter(tiers.values())).tiers
    namespace = f"bench-{uuid.uuid4().hex[:12]}"
    frame = assemble_prompt(tokenizer, "q", [], max_prompt_tokens=args.context).num_tokens
    per_doc = max(32, (args.context - frame - 48) // args.docs)
    items = load_bench_items(
        args.data,
        args.format,
        types,
        args.skip,
        args.seed,
        count_tokens=lambda text: len(encode_user_text(tokenizer, text)),
        tokens=per_doc,
    )[: max(args.questions, args.pool)]
    if len(items) < args.pool:
        raise ConfigError(
            f"the data give only {len(items)} items, --pool {args.pool}", field="data"
        )
    passages = build_passages(tokenizer, items, per_doc, args.seed, args.needle_digits)

    def layout_of(question: str, docs: list[Any], prefix: str = "") -> Any:
        return assemble_prompt(
            tokenizer, question, docs, max_prompt_tokens=args.context * 2, answer_prefix=prefix
        )

    first = next(iter(tiers.values()))
    rng = random.Random(args.seed + 1)
    rows: list[dict[Any, Any]] = []
    read_s = 0.0
    for q in range(min(args.questions, len(items))):
        low = min(q - q % args.pool, len(items) - args.pool)  # this question's pool
        window = list(range(low, low + args.pool))
        if q % args.pool == 0:  # read the pool once, as earlier traffic would
            started = time.perf_counter()
            for i in range(0, args.pool, args.docs):
                group = [passages[j].doc for j in window[i : i + args.docs]]
                stored.finish(
                    first.prefill(layout_of("Read.", group), press, "Read.", namespace)[1]
                )
            read_s += _since(started)
        entry = passages[q]
        order = [q, *rng.sample([i for i in window if i != q], args.docs - 1)]
        rng.shuffle(order)
        needle = bool(args.needle_every) and q % args.needle_every == args.needle_every - 1
        if needle:
            question, kind, answers = entry.needle_question, "needle", [entry.needle_value]
        else:
            question, kind, answers = entry.item.question, entry.item.type, entry.item.answers
        layout = layout_of(
            question, [passages[i].doc for i in order], entry.needle_prefix if needle else ""
        )
        target: dict[str, Any] = {"item_type": kind, "answers": answers, "gold_ids": [entry.doc.id]}
        roles = prompt_roles(tokenizer, layout)
        focus = prompt_focus(tokenizer, layout) if uses_focus(press) else None
        started = time.perf_counter()
        cold = runtime.prefill(layout.input_ids, press, roles=roles, focus=focus)
        cold_s = _since(started)
        cold_tokens = runtime.generate(cold, generation)
        reference = full_reference(runtime, cold, cold_tokens)
        row: dict[Any, Any] = {
            "dataset": entry.dataset,
            "prompt_tokens": layout.num_tokens,
            "needle": needle,
            "cold_s": cold_s,
            "cold": answer_scores(runtime, layout, question, cold, cold_tokens, **target),
        }
        for share, tier in tiers.items():
            started = time.perf_counter()
            reused, report = tier.prefill(layout, press, question, namespace)
            reuse_s = _since(started)
            if report.tier != "documents":
                raise ConfigError(
                    f"the per-document tier did not serve ({report.tier}: {report.reuse_note})"
                )
            tokens = runtime.generate(reused, generation)
            log_probs = (
                runtime.teacher_force([reused], reference.tokens)[0] if reference.tokens else None
            )
            fid = compare(log_probs if log_probs is not None else torch.empty(0, 0), reference)
            top1 = (
                float((log_probs.argmax(-1) == reference.targets).float().mean())
                if log_probs is not None
                else 1.0
            )
            row[share] = {
                "ttft_s": reuse_s,
                "kl": fid["kl"],
                "match": tokens == cold_tokens,
                "top1": top1,
                "recomputed": report.recomputed_tokens,
                **answer_scores(runtime, layout, question, reused, tokens, **target),
            }
            store.delete(
                tiers[share].tiers.entry_keys(layout, press.config(), question, namespace)[0]
            )  # no exact hit next
        rows.append(row)
        logger.info(
            "question %d: cold %.2fs, %s",
            q + 1,
            cold_s,
            {s: round(row[s]["ttft_s"], 2) for s in tiers},
        )
    store.close()
    scratch.cleanup()
    result: dict[str, Any] = {
        "model": runtime.loaded.model_id,
        "device": str(runtime.loaded.device),
        "dtype": str(next(runtime.loaded.model.parameters()).dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "press": press.config(),
        "select": selects,
        "data": [str(p) for p in args.data],
        "skip": args.skip,
        "questions": len(rows),
        "datasets": {
            d: sum(r["dataset"] == d for r in rows) for d in sorted({r["dataset"] for r in rows})
        },
        "needle_questions": sum(r["needle"] for r in rows),
        "pool": args.pool,
        "docs_per_prompt": args.docs,
        "prompt_tokens_median": statistics.median(r["prompt_tokens"] for r in rows),
        "pool_read_s": round(read_s, 2),
        "ttft_cold_s_median": round(statistics.median(r["cold_s"] for r in rows), 4),
        **run_summary(rows, list(tiers), shares[0] == 0),
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for field, value in result.items():
            print(f"{field:>24}: {value}")
    return 0
