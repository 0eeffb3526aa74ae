"""What a cold miss pays for reuse, and what the next questions over its documents get.

One BioASQ question's snippets padded with other questions' to about ``--context`` tokens;
each step runs on a fresh engine over the same file store (another process, as a CLI user
meets it: no in-memory tier carries over):

1. cold          question A over the documents (given order): prefill, answer, write.
2. same layout   question B over the same documents in the same order.
3. reordered     question C over the same documents in another order.

Prints one JSON object: per step the cache status and tier, first-token and total seconds,
tokens prefilled, bytes written and read (``cache_bytes_written`` counts the deferred writes),
and the store's size after each step. Run it with the same ``--threads`` on each commit to
compare (``PYTHONPATH=<checkout>``).

    .venv/bin/python lab/scripts/miss_and_reuse.py --threads 1 --context 4500
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

DATA = (
    Path(__file__).resolve().parents[2].parent
    / "shared/data/bioasq/Task10BGoldenEnriched/10B1_golden.json"
)


def _store_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--context", type=int, default=4500)
    parser.add_argument("--item", type=int, default=0, help="which factoid question's snippets")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--share", type=float, help="recompute share of a document hit")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from ragsnap.cache import open_store
    from ragsnap.engine.engine import RagSnapEngine
    from ragsnap.eval.bioasq import load_bioasq
    from ragsnap.runtime.generation import GenerationConfig
    from ragsnap.runtime.loading.models import EMBEDDED, load_model

    loaded = load_model(EMBEDDED)
    tokenizer = loaded.tokenizer
    items = load_bioasq(
        [args.data],
        context_tokens=args.context,
        count_tokens=lambda text: len(tokenizer.encode(text)),
        types=("factoid",),
    ).items
    item = items[args.item]
    questions = [item.question, items[args.item + 1].question, items[args.item + 2].question]
    documents = list(item.documents)
    shuffled = documents[:]
    random.Random(1).shuffle(shuffled)
    scratch = tempfile.TemporaryDirectory(prefix="ragsnap-miss-reuse-")  # removed at exit
    folder = Path(scratch.name)
    steps = []
    for name, question, docs in (
        ("cold", questions[0], documents),
        ("same layout", questions[1], documents),
        ("reordered", questions[2], shuffled),
    ):
        settings = {} if args.share is None else {"recompute_share": args.share}
        store = open_store(f"file://{folder}")
        engine = RagSnapEngine(loaded, store=store, threads=args.threads, **settings)
        options = engine.default_options(
            document_order="given",
            generation=GenerationConfig(max_new_tokens=args.max_new_tokens),
        )
        started = time.perf_counter()
        done = engine.answer(question, docs, options)
        total = time.perf_counter() - started
        stats = done.stats
        steps.append(
            {
                "step": name,
                "cache": stats.cache,
                "tier": stats.cache_tier,
                "prompt_tokens": stats.prompt_tokens,
                "prefill_tokens": stats.prefill_tokens,
                "ttft_s": stats.ttft_s,
                "load_s": stats.cache_load_s,
                "prefill_s": stats.prefill_s,
                "compress_s": stats.compress_s,
                "total_s": round(total, 3),
                "bytes_written": stats.cache_bytes_written,
                "bytes_read": stats.cache_bytes_read,
                "store_bytes": _store_bytes(folder),
                "answer": done.answer[:80],
            }
        )
        engine.store.close()
    kv_per_token = 2 * 30 * 3 * 64 * next(loaded.model.parameters()).element_size()
    print(
        json.dumps(
            {
                "threads": args.threads,
                "dtype": str(next(loaded.model.parameters()).dtype),
                "full_kv_bytes": steps[0]["prompt_tokens"] * kv_per_token,
                "steps": steps,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
