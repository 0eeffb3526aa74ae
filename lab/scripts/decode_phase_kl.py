"""KL to the full cache along long answers: decode-phase SnapKV against prefill-only
compression that ends with the same cache size (issue 15's target).

For each BioASQ item the full cache answers greedily (up to ``--max-new-tokens``); that
answer is then forced through (a) the prompt compressed to ``--budget`` with no decode
compression (its cache ends at budget + answer length) and (b) the prompt compressed to
budget + answer length - slack, re-selected while decoding with ``--slack`` (its cache
ends at most at the same size), and (c) the prompt at ``--budget`` with the same slack
(a cache of at most budget + slack). Forcing runs through the real decode loop, so (b)
and (c) re-select exactly as when they answer. Prints JSON: mean KL(full || compressed)
per position, in nats, per variant.

    OMP_NUM_THREADS=1 .venv/bin/python lab/scripts/decode_phase_kl.py \\
        --data ../shared/data/bioasq/Task10BGoldenEnriched --limit 8 --budget 128 --slack 32
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from ragsnap.compression import FullPress, make_press
from ragsnap.compression.decode_snapkv import DecodeSnapKV
from ragsnap.engine.engine import RagSnapEngine
from ragsnap.eval.datasets import load_items
from ragsnap.eval.fidelity import compare, fidelities, full_reference
from ragsnap.runtime.generation import GenerationConfig


def forced_log_probs(engine, prefill, tokens, decode) -> torch.Tensor:
    """``[n, V]`` log-probs after each of ``tokens``, decoding them as a row of the real
    decode loop (with ``decode`` re-selection) instead of sampling."""
    seen: list[torch.Tensor] = []

    def force(so_far: list[int], logits: torch.Tensor) -> torch.Tensor:
        if so_far:  # logits after feeding so_far[-1]; the prefill's own step is not compared
            seen.append(torch.log_softmax(logits[0].float(), dim=-1))
        forced = torch.full_like(logits, float("-inf"))
        forced[0, tokens[len(so_far)] if len(so_far) < len(tokens) else 0] = 0.0
        return forced

    batch = engine.runtime.decode_batch(stop_ids=set())
    batch.add(0, prefill, GenerationConfig(max_new_tokens=len(tokens) + 1), None, force, decode)
    for _ in batch.run():
        pass
    return torch.stack(seen[: len(tokens)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--slack", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--context-tokens", type=int, default=2000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    engine = RagSnapEngine.load("embedded", device="cpu", dtype="float32")
    count = lambda text: len(engine.tokenizer(text).input_ids)  # noqa: E731
    items = load_items(
        "bioasq",
        args.data,
        context_tokens=args.context_tokens,
        count_tokens=count,
        types=("summary",),
    ).items[: args.limit]
    generation = GenerationConfig(max_new_tokens=args.max_new_tokens)
    decode = DecodeSnapKV(slack=args.slack)
    rows = []
    for item in items:
        layout = engine.build_prompt(item.question, item.documents, generation)
        full = engine.runtime.prefill(layout.input_ids, FullPress())
        batch = engine.runtime.decode_batch()
        row = batch.add(0, full, generation)
        for _ in batch.run():
            pass
        reference = full_reference(engine.runtime, full, row.tokens)
        n = len(row.tokens)
        small, large = (
            engine.runtime.prefill(layout.input_ids, make_press("ragsnap", budget=b))
            for b in (args.budget, args.budget + n - args.slack)
        )
        prefill_only = fidelities(engine.runtime, [small], reference)[0]["kl"]
        same_size = compare(forced_log_probs(engine, large, row.tokens, decode), reference)["kl"]
        bounded = compare(forced_log_probs(engine, small, row.tokens, decode), reference)["kl"]
        rows.append(
            {
                "item": item.id,
                "answer_tokens": n,
                "prefill_only": prefill_only,
                "decode_same_final_size": same_size,
                "decode_bounded": bounded,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    mean = {
        k: round(statistics.mean(r[k] for r in rows), 4)
        for k in ("prefill_only", "decode_same_final_size", "decode_bounded")
    }
    print(json.dumps({"n": len(rows), "budget": args.budget, "slack": args.slack, "mean_kl": mean}))


if __name__ == "__main__":
    main()
