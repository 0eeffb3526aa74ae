"""Where a per-document assembly spends its time (issue 44): stage timers around the tier.

Reads 16 held-out passages (HotpotQA items after ``--skip``) once, then for ``--items``
prompts of 8 of them prefills cold and through the per-document tier at ``--share``, and
prints the mean seconds per prompt of each stage: loading the pieces, re-encoding and
placing them, the question probe, the recompute, the deviation pass (when selected), and
the whole reused prefill (the rest is the tail's prefill and the press); and what a cold
miss pays after its answer to compute its documents' pieces for the tier.

    .venv/bin/python lab/scripts/reuse_profile.py --share 0.12 --items 6
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

HOTPOTQA = "../shared/data/hotpotqa/camera_ready_nd8_dev_sample100.json"


def main() -> None:
    from ragsnap.cache import open_store
    from ragsnap.cache.tiers import documents
    from ragsnap.cache.tiers.cached_prefill import CachedPrefill
    from ragsnap.cli.bench.reuse_items import build_passages, load_bench_items
    from ragsnap.compression import make_press
    from ragsnap.engine.loading import plain_runtime
    from ragsnap.prompt.assembly import assemble_prompt
    from ragsnap.runtime import blend

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--share", type=float, default=documents.DEFAULT_RECOMPUTE_SHARE)
    parser.add_argument("--select", default=blend.DEFAULT_SELECTION)
    parser.add_argument("--items", type=int, default=6)
    parser.add_argument("--skip", type=int, default=60)
    parser.add_argument("--dtype")
    parser.add_argument("--data", default=HOTPOTQA)
    args = parser.parse_args()
    torch.set_num_threads(1)
    runtime = plain_runtime(**({"dtype": args.dtype} if args.dtype else {}))
    tok = runtime.tokenizer
    press = make_press("snapkv", budget=512)
    per_doc = (4096 - assemble_prompt(tok, "q", [], max_prompt_tokens=4096).num_tokens - 48) // 8
    items = load_bench_items([Path(args.data)], None, ("short",), args.skip, 0)[:16]
    passages = build_passages(tok, items, per_doc, 0)
    scratch = tempfile.TemporaryDirectory()
    store = open_store(f"file://{scratch.name}")
    tier = CachedPrefill(
        runtime,
        runtime.loaded,
        store,
        prefix_cache=False,
        document_cache=True,
        recompute_share=args.share,
        recompute_select=args.select,
    )
    namespace = "profile-" + uuid.uuid4().hex[:6]

    def layout_of(question: str, docs: list[Any]) -> Any:
        return assemble_prompt(tok, question, docs, max_prompt_tokens=8192)

    for i in range(0, 16, 8):
        group = [p.doc for p in passages[i : i + 8]]
        tier.finish(tier.prefill(layout_of("Read.", group), press, "Read.", namespace)[1])
    seconds: dict[str, float] = collections.defaultdict(float)
    _time(blend, "_assemble", "re-encode and place", seconds)
    _time(blend, "question_attention", "probe (all layers)", seconds)
    _time(blend, "early_question_attention", "probe (early layers)", seconds)
    _time(blend, "recompute", "recompute", seconds)
    _time(blend, "_by_deviation", "deviation pass", seconds)
    _time(documents.DocumentTier, "_load", "load pieces", seconds)
    _time(documents.DocumentTier, "assemble", "assembly in all", seconds)
    rng, ratios = random.Random(3), []
    for q in range(args.items):
        order = [q, *rng.sample([i for i in range(16) if i != q], 7)]
        rng.shuffle(order)
        question = passages[q].item.question
        layout = layout_of(question, [passages[i].doc for i in order])
        started = time.perf_counter()
        runtime.prefill(layout.input_ids, press)
        cold = time.perf_counter() - started
        started = time.perf_counter()
        _, report = tier.prefill(layout, press, question, namespace)
        reused = time.perf_counter() - started
        assert report.tier == "documents", report.reuse_note
        store.delete(tier.entry_keys(layout, press, question, namespace)[0])
        seconds["cold prefill"] += cold
        # what a miss pays after its answer to store its documents' pieces
        slots = [s for s in tier.documents.slots(layout, namespace) if s is not None]
        head_ids = layout.input_ids[: layout.doc_spans[0][0]]
        started = time.perf_counter()
        tier.runner.document_pieces(
            head_ids, [s.body for s in slots], tier.documents.head(head_ids)
        )
        seconds["pieces of a miss (after its answer)"] += time.perf_counter() - started
        seconds["reused prefill"] += reused
        ratios.append(cold / reused)
    out: dict[str, Any] = {k: round(v / args.items, 3) for k, v in seconds.items()}
    out["first_token_speedup_median"] = round(statistics.median(ratios), 2)
    print(json.dumps(out, indent=1))


def _time(owner: Any, name: str, label: str, seconds: dict[str, float]) -> None:
    """Wrap ``owner.name`` so its calls add their seconds to ``seconds[label]``."""
    inner = getattr(owner, name)

    def timed(*a: Any, **k: Any) -> Any:
        started = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            seconds[label] += time.perf_counter() - started

    setattr(owner, name, timed)


if __name__ == "__main__":
    main()
