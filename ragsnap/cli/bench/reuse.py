"""``ragsnap bench reuse``: per-document KV reuse against cold prefills, at several recompute shares.

A pool of passages (HotpotQA paragraphs grouped to about ``context / docs`` tokens each,
every one carrying a needle sentence with its own number) is read once: prompts of ``docs``
passages go through the cache tiers, which store each passage's piece. Then every question
takes a new combination and order of pool passages (its own passage among them) and is
answered cold and through the per-document tier at each ``--shares`` value, with the same
press and budget. Per share: time to first token against cold (median of per-question
ratios), mean teacher-forced KL(cold || reused) along the cold answer and its ratio to
plain concatenation's (share 0), agreement with the cold greedy answer (exact, and top-1
per position), and how often a needle in a reused passage is found, against cold.
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

from ragsnap.cli.options import add_dtype_option
from ragsnap.cli.progress import loading_model
from ragsnap.errors import ConfigError
from ragsnap.runtime.blend import DEFAULT_SELECTION, SELECTIONS

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data",
        required=True,
        help="a HotpotQA JSON list (MIRAGE layout), e.g. "
        "../shared/data/hotpotqa/camera_ready_nd8_dev_sample100.json",
    )
    parser.add_argument("--pool", type=int, default=32, help="passages read once")
    parser.add_argument("--docs", type=int, default=8, help="passages per prompt")
    parser.add_argument("--questions", type=int, default=30, help="questions (half are needles)")
    parser.add_argument("--context", type=int, default=4096, help="prompt length in tokens")
    parser.add_argument("--shares", default="0,0.15,0.3,1", help="recompute shares to measure")
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


def build_pool(
    path: Path, tokenizer: Any, size: int, tokens: int, seed: int
) -> list[dict[str, Any]]:
    """``size`` passages of about ``tokens`` tokens: ``{"doc", "question", "needle"}`` each."""
    from ragsnap.eval.niah import ANSWER_PREFIX, NEEDLE, QUESTION, _random_needle
    from ragsnap.prompt.assembly import encode_user_text
    from ragsnap.prompt.documents import Document

    records = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(records, list):
        raise ConfigError(f"{path}: expected a JSON list of HotpotQA records", field="data")
    rng = random.Random(seed)
    pool: list[dict[str, Any]] = []
    for record in records:
        if len(pool) == size:
            break
        paragraphs = ["".join(record.get(f"para_{k}") or []) for k in ("a", "b")]
        paragraphs += ["".join(e[1]) for e in record.get("distractors") or [] if len(e) > 1]
        sentences: list[str] = []
        for paragraph in paragraphs:
            sentences.append(paragraph.strip())
            if len(encode_user_text(tokenizer, " ".join(sentences))) >= tokens:
                break
        text = " ".join(sentences)
        ids = encode_user_text(tokenizer, text)
        text = tokenizer.decode(ids[:tokens])
        needle = _random_needle(rng)
        cut = text.rfind(". ", 0, len(text) // 2) + 1  # the middle, at a sentence end
        text = f"{text[:cut]} {NEEDLE.format(key=needle.key, value=needle.value)}{text[cut:]}"
        title = str(record.get("title_a", f"passage {len(pool)}"))
        pool.append(
            {
                "doc": Document(id=f"p{len(pool)}", title=title, text=text),
                "question": str(record["question"]),
                "needle": {
                    "value": needle.value,
                    "question": QUESTION.format(key=needle.key),
                    "prefix": ANSWER_PREFIX.format(key=needle.key),
                },
            }
        )
    if len(pool) < size:
        raise ConfigError(f"{path} gives only {len(pool)} passages, --pool {size}", field="data")
    return pool


def _since(started: float) -> float:
    """Seconds since ``started`` (after the device finished its queued work)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - started


def run(args: argparse.Namespace) -> int:  # noqa: PLR0915 - one benchmark, start to end
    from ragsnap.cache import open_store
    from ragsnap.cache.tiers.cached_prefill import CachedPrefill
    from ragsnap.compression import make_press
    from ragsnap.compression.lookup_focus import uses_focus
    from ragsnap.engine.loading import plain_runtime
    from ragsnap.engine.options import given_fields
    from ragsnap.eval.fidelity import compare, full_reference
    from ragsnap.prompt.assembly import assemble_prompt
    from ragsnap.prompt.focus import prompt_focus
    from ragsnap.prompt.structure import prompt_roles
    from ragsnap.runtime.generation import GenerationConfig

    shares = sorted({float(s) for s in args.shares.split(",") if s.strip()})
    if not shares or min(shares) < 0 or max(shares) > 1 or args.docs < 2 or args.pool < args.docs:
        raise ConfigError("need shares in [0, 1], --docs >= 2 and --pool >= --docs")
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
    tiers = {
        name(share, select): CachedPrefill(
            runtime,
            runtime.loaded,
            store,
            prefix_cache=False,
            document_cache=True,
            recompute_share=share,
            recompute_select=select,
        )
        for share, select in variants
    }
    namespace = f"bench-{uuid.uuid4().hex[:12]}"
    frame = assemble_prompt(tokenizer, "q", [], max_prompt_tokens=args.context).num_tokens
    per_doc = max(32, (args.context - frame - 48) // args.docs)
    pool = build_pool(Path(args.data), tokenizer, args.pool, per_doc, args.seed)

    def layout_of(question: str, docs: list[Any], prefix: str = "") -> Any:
        return assemble_prompt(
            tokenizer, question, docs, max_prompt_tokens=args.context * 2, answer_prefix=prefix
        )

    # read the pool once, as earlier traffic would: each passage's piece is stored
    first = next(iter(tiers.values()))
    started = time.perf_counter()
    for i in range(0, len(pool), args.docs):
        group = [p["doc"] for p in pool[i : i + args.docs]]
        first.finish(first.prefill(layout_of("Read.", group), press, "Read.", namespace)[1])
    read_s = _since(started)
    rng = random.Random(args.seed + 1)
    rows: list[dict[Any, Any]] = []
    for q in range(args.questions):
        target = rng.randrange(len(pool))
        others = rng.sample([i for i in range(len(pool)) if i != target], args.docs - 1)
        order = [target, *others]
        rng.shuffle(order)
        needle = q % 2 == 1
        entry = pool[target]
        question = entry["needle"]["question"] if needle else entry["question"]
        layout = layout_of(
            question, [pool[i]["doc"] for i in order], entry["needle"]["prefix"] if needle else ""
        )
        roles = prompt_roles(tokenizer, layout)
        focus = prompt_focus(tokenizer, layout) if uses_focus(press) else None
        started = time.perf_counter()
        cold = runtime.prefill(layout.input_ids, press, roles=roles, focus=focus)
        cold_s = _since(started)
        cold_tokens = runtime.generate(cold, generation)
        reference = full_reference(runtime, cold, cold_tokens)
        row: dict[Any, Any] = {
            "prompt_tokens": layout.num_tokens,
            "needle": needle,
            "cold_s": cold_s,
        }
        row["cold_found"] = needle and entry["needle"]["value"] in tokenizer.decode(cold_tokens)
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
                "found": needle and entry["needle"]["value"] in tokenizer.decode(tokens),
                "recomputed": report.recomputed_tokens,
            }
            store.delete(
                tier.entry_keys(layout, press, question, namespace)[0]
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
    needles = [r for r in rows if r["needle"]]
    base_kl = statistics.fmean(r["0.0"]["kl"] for r in rows) if shares[0] == 0 else None
    result: dict[str, Any] = {
        "model": runtime.loaded.model_id,
        "device": str(runtime.loaded.device),
        "dtype": str(next(runtime.loaded.model.parameters()).dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "press": press.config(),
        "select": selects,
        "questions": len(rows),
        "pool": args.pool,
        "docs_per_prompt": args.docs,
        "prompt_tokens_median": statistics.median(r["prompt_tokens"] for r in rows),
        "pool_read_s": round(read_s, 2),
        "ttft_cold_s_median": round(statistics.median(r["cold_s"] for r in rows), 4),
        "needle_found_cold": _rate(r["cold_found"] for r in needles),
        "shares": {},
    }
    for share in tiers:
        stats = [r[share] for r in rows]
        kl = statistics.fmean(s["kl"] for s in stats)
        result["shares"][str(share)] = {
            "ttft_s_median": round(statistics.median(s["ttft_s"] for s in stats), 4),
            "ttft_speedup_median": round(
                statistics.median(r["cold_s"] / r[share]["ttft_s"] for r in rows), 2
            ),
            "kl_mean": round(kl, 5),
            "kl_over_concat": None if not base_kl else round(kl / base_kl, 3),
            "answer_agreement": _rate(s["match"] for s in stats),
            "top1_agreement": round(statistics.fmean(s["top1"] for s in stats), 3),
            "needle_found": _rate(s["found"] for s in (r[share] for r in needles)),
            "recomputed_tokens_mean": round(statistics.fmean(s["recomputed"] for s in stats), 1),
        }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for field, value in result.items():
            print(f"{field:>24}: {value}")
    return 0


def _rate(flags: Any) -> float | None:
    values = [bool(f) for f in flags]
    return round(sum(values) / len(values), 3) if values else None
