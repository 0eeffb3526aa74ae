"""Calibrate the per-document tier's recompute selection on held-out items (issue 44).

For each of ``n`` items (HotpotQA and BioASQ factoid interleaved, after the first ``skip``
of each set), a prompt of 8 passages from a pool of 16 already read is prefilled cold and
through the per-document tier under every variant; each variant's teacher-forced KL to the
cold run along the cold greedy answer (16 tokens) and its first-token speed-up are printed,
KL also as a ratio to the first variant's (put plain concatenation, share 0, first).

A variant is a JSON object: ``share``, ``select`` (a ``recompute_select``), and optional
overrides of module constants for the run: ``lead`` (``blend.LEAD_TOKENS``), ``blocks``
(recompute passes), ``early`` (``blend_select.EARLY_PROBE_LAYERS``) and ``pool`` (max-pool
the question scores over this many neighbouring positions).

    .venv/bin/python lab/scripts/reuse_selection.py --items 6 --skip 60 \\
      '[{"name": "concat", "share": 0}, {"name": "q15", "share": 0.15, "select": "question"}]'
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

DATA = (
    "../shared/data/hotpotqa/camera_ready_nd8_dev_sample100.json",
    "../shared/data/bioasq/Task10BGoldenEnriched",
)


def main() -> None:
    from ragsnap.cache import open_store
    from ragsnap.cli.bench.reuse import document_reuse
    from ragsnap.cli.bench.reuse_items import build_passages, load_bench_items
    from ragsnap.compression import make_press
    from ragsnap.engine.loading import plain_runtime
    from ragsnap.eval.fidelity import compare, full_reference
    from ragsnap.prompt.assembly import assemble_prompt, encode_user_text
    from ragsnap.runtime import blend, blend_select
    from ragsnap.runtime.generation import GenerationConfig

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("variants", help="a JSON list of variants")
    parser.add_argument("--items", type=int, default=6)
    parser.add_argument("--skip", type=int, default=60, help="held out: after these items")
    parser.add_argument("--dtype", help="the model's dtype (default: the configured one)")
    parser.add_argument("--data", nargs="+", default=list(DATA))
    args = parser.parse_args()
    variants: list[dict[str, Any]] = json.loads(args.variants)
    torch.set_num_threads(1)
    runtime = plain_runtime(**({"dtype": args.dtype} if args.dtype else {}))
    tok = runtime.tokenizer
    press = make_press("snapkv", budget=512)
    per_doc = (4096 - assemble_prompt(tok, "q", [], max_prompt_tokens=4096).num_tokens - 48) // 8
    items = load_bench_items(
        [Path(p) for p in args.data],
        None,
        ("factoid", "short"),
        args.skip,
        0,
        count_tokens=lambda t: len(encode_user_text(tok, t)),
        tokens=per_doc,
    )[:16]
    passages = build_passages(tok, items, per_doc, 0)
    scratch = tempfile.TemporaryDirectory()
    store = open_store(f"file://{scratch.name}")
    tiers = {
        v["name"]: document_reuse(
            runtime, store, v["share"], v.get("select", blend.DEFAULT_SELECTION)
        )
        for v in variants
    }
    namespace = "calibrate-" + uuid.uuid4().hex[:6]

    def layout_of(question: str, docs: list[Any]) -> Any:
        return assemble_prompt(tok, question, docs, max_prompt_tokens=8192)

    reader = next(iter(tiers.values()))
    for i in range(0, 16, 8):
        group = [p.doc for p in passages[i : i + 8]]
        reader.tiers.finish(reader.prefill(layout_of("Read.", group), press, "Read.", namespace)[1])
    defaults = (blend.LEAD_TOKENS, blend.recompute_blocks, blend_select.EARLY_PROBE_LAYERS)
    probes = (blend.question_attention, blend.early_question_attention)
    rng = random.Random(7)
    results: dict[str, dict[str, list[float]]] = {v["name"]: {"kl": [], "x": []} for v in variants}
    for q in range(args.items):
        order = [q, *rng.sample([i for i in range(16) if i != q], 7)]
        rng.shuffle(order)
        question = passages[q].item.question
        layout = layout_of(question, [passages[i].doc for i in order])
        started = time.perf_counter()
        cold = runtime.prefill(layout.input_ids, press)
        cold_s = time.perf_counter() - started
        reference = full_reference(runtime, cold, runtime.generate(cold, GenerationConfig(16)))
        for v in variants:
            _configure(blend, blend_select, v, defaults, probes)
            tier = tiers[v["name"]]
            started = time.perf_counter()
            reused, report = tier.prefill(layout, press, question, namespace)
            seconds = time.perf_counter() - started
            assert report.tier == "documents", report.reuse_note
            store.delete(tier.tiers.entry_keys(layout, press.config(), question, namespace)[0])
            log_probs = runtime.teacher_force([reused], reference.tokens)[0]
            results[v["name"]]["kl"].append(compare(log_probs, reference)["kl"])
            results[v["name"]]["x"].append(cold_s / seconds)
        print(q, {k: round(r["kl"][-1], 4) for k, r in results.items()}, flush=True)
    base = statistics.fmean(results[variants[0]["name"]]["kl"])
    for name, r in results.items():
        kl = statistics.fmean(r["kl"])
        print(
            f"{name:24s} KL {kl:.4f}  / first {kl / base:.3f}  "
            f"first token {statistics.median(r['x']):.2f}x"
        )


def _configure(
    blend: Any, blend_select: Any, v: dict[str, Any], defaults: tuple, probes: tuple
) -> None:
    """Set the module constants one variant overrides (the defaults otherwise)."""
    lead, blocks, early = defaults
    blend.LEAD_TOKENS = v.get("lead", lead)
    passes = int(v.get("blocks", blend.RECOMPUTE_BLOCKS))
    blend.recompute_blocks = lambda at: blocks(at, passes)
    blend_select.EARLY_PROBE_LAYERS = v.get("early", early)
    pool = int(v.get("pool", 0))
    blend.question_attention, blend.early_question_attention = (
        (_pooled(p, pool) for p in probes) if pool else probes
    )


def _pooled(probe: Any, kernel: int) -> Any:
    def pooled(*a: Any, **k: Any) -> torch.Tensor:
        score = probe(*a, **k)
        return F.max_pool1d(score.view(1, 1, -1), kernel, 1, kernel // 2).view(-1)

    return pooled


if __name__ == "__main__":
    main()
