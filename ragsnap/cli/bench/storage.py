"""``ragsnap bench storage``: what a smaller stored entry costs in bytes, load time and
fidelity.

For each prompt, the default press compresses it once (``--press``, ``--budget``); the
entry is stored and read back in each ``--dtypes`` (plus the model's own dtype, the
reference), and every copy is teacher-forced along the answer that the full, uncompressed
cache gives. Reported per dtype: the entry's bytes and its ratio to the model dtype's,
the load time of a hit, and the mean KL to the full cache, beside the compression's own
KL (the model dtype's copy), so the storage's share of the loss reads directly.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ragsnap.cli.options import add_model_options

    add_model_options(parser)
    parser.add_argument("--dtypes", default="bfloat16,int8", help="stored dtypes to compare")
    parser.add_argument("--context", type=int, default=2048, help="prompt tokens")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--press", default="ragsnap-lookahead")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=32)


def run(args: argparse.Namespace) -> int:
    import torch

    from ragsnap.cache import open_store
    from ragsnap.cache.serialization import parse_dtype
    from ragsnap.cache.tiers.cached_prefill import CachedPrefill
    from ragsnap.cli.bench.decode import layout_of_length
    from ragsnap.compression import make_press
    from ragsnap.engine.execute import PlanExecutor
    from ragsnap.engine.loading import plain_runtime
    from ragsnap.engine.options import given_fields
    from ragsnap.eval.fidelity import compare, full_reference
    from ragsnap.runtime.blend import DEFAULT_SELECTION
    from ragsnap.runtime.generation import GenerationConfig

    torch.set_num_threads(args.threads)
    runtime = plain_runtime(**given_fields(args))
    press = make_press(args.press, budget=args.budget)
    full_press = make_press("full")
    generation = GenerationConfig(max_new_tokens=args.max_new_tokens)
    names = ["model", *[d.strip() for d in args.dtypes.split(",") if d.strip()]]
    scratch = tempfile.TemporaryDirectory(prefix="ragsnap-bench-storage-")
    store = open_store(f"file://{scratch.name}")
    tiers = {
        name: CachedPrefill(
            runtime.loaded,
            store,
            runtime.cache_from,
            prefix_cache=False,
            storage_dtype=None if name == "model" else parse_dtype(name),
            hit_memory_bytes=0,
        )
        for name in names
    }
    executors = {
        name: PlanExecutor(runtime, tier, 0.0, DEFAULT_SELECTION) for name, tier in tiers.items()
    }
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for seed in range(args.prompts):
        layout = layout_of_length(runtime, args.context, seed=seed)
        full = runtime.prefill(layout.input_ids, full_press)
        reference = full_reference(runtime, full, runtime.generate(full, generation))
        for name, tier in tiers.items():
            question = f"storage {seed}"
            _, miss = executors[name].prefill(layout, press, question, "bench")
            tier.finish(miss)
            started = time.perf_counter()
            hit, report = executors[name].prefill(layout, press, question, "bench")
            load_s = time.perf_counter() - started
            if report.status != "hit":
                raise RuntimeError(f"{name}: the stored entry did not load ({report.status})")
            log_probs = runtime.teacher_force([hit], reference.tokens)[0]
            rows[name].append(
                {"bytes": miss.bytes_written, "load_s": load_s, **compare(log_probs, reference)}
            )
    base_bytes = statistics.fmean(r["bytes"] for r in rows["model"])
    base_kl = statistics.fmean(r["kl"] for r in rows["model"])
    summary: dict[str, Any] = {}
    for name, found in rows.items():
        kl = statistics.fmean(r["kl"] for r in found)
        size = statistics.fmean(r["bytes"] for r in found)
        summary[name] = {
            "entry_bytes": round(size),
            "bytes_ratio": round(size / base_bytes, 3),
            "hit_load_s_median": round(statistics.median(r["load_s"] for r in found), 4),
            "kl_to_full_mean": round(kl, 5),
            "kl_added_by_storage": round(kl - base_kl, 5),
        }
    setup = {
        "model": runtime.loaded.model_id,
        "dtype": str(runtime.loaded.model.dtype),
        "threads": args.threads,
        "press": args.press,
        "budget": args.budget,
        "context": args.context,
        "prompts": args.prompts,
        "answer_tokens": args.max_new_tokens,
    }
    print(json.dumps({"setup": setup, "storage": summary}, indent=2))
    scratch.cleanup()
    return 0
