"""Passes and seconds of the lookahead draft on BioASQ factoid prompts: one-token passes
against guesses from the prompt's n-grams (``draft_queries(..., context=prompt)``), and
whether both drafts are the same tokens. Prints one JSON object.

    .venv/bin/python lab/scripts/draft_passes.py --data ../shared/data/bioasq/Task10BGoldenEnriched -n 20
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="a BioASQ folder or file")
    parser.add_argument("-n", type=int, default=20, help="factoid items (the first n)")
    parser.add_argument("--max-tokens", type=int, default=1500, help="prompt tokens kept")
    parser.add_argument("--draft", type=int, default=8, help="tokens drafted")
    args = parser.parse_args()

    import torch
    from transformers import DynamicCache

    from ragsnap.engine.engine import RagSnapEngine
    from ragsnap.eval.datasets import load_items
    from ragsnap.runtime.generation import GenerationConfig
    from ragsnap.runtime.prefill import draft_queries, drain, forward_chunk

    engine = RagSnapEngine.load(cache_url="none", threads=1)
    model, kwarg = engine.loaded.model, engine.loaded.cache_kwarg
    items = load_items("bioasq", args.data, types=("factoid",)).items[: args.n]
    real = model.forward
    totals = {"plain": [0, 0.0], "guessed": [0, 0.0]}
    same = 0
    for item in items:
        layout = engine.build_prompt(
            item.question, item.documents, GenerationConfig(max_new_tokens=8), order="given"
        )
        prompt = list(layout.input_ids)[: args.max_tokens]
        drafted = {}
        for name, context in (("plain", ()), ("guessed", prompt)):
            cache = DynamicCache(config=model.config)
            logits = forward_chunk(model, kwarg, prompt, cache, 0)
            calls: list[int] = []

            def counted(*a, calls=calls, **k):  # type: ignore[no-untyped-def]
                calls.append(k["input_ids"].shape[1])
                return real(*a, **k)

            model.forward = counted
            started = time.perf_counter()
            with torch.inference_mode():
                _, drafted[name] = drain(
                    draft_queries(
                        model,
                        kwarg,
                        cache,
                        logits,
                        len(prompt),
                        args.draft,
                        engine.runtime.stop_ids,
                        context,
                    )
                )
            totals[name][1] += time.perf_counter() - started
            del model.forward
            totals[name][0] += len(calls)
        same += drafted["plain"] == drafted["guessed"]
    print(
        json.dumps(
            {
                "n": len(items),
                "dtype": str(next(model.parameters()).dtype),
                "passes": {k: v[0] for k, v in totals.items()},
                "seconds": {k: round(v[1], 2) for k, v in totals.items()},
                "same_tokens": same,
            }
        )
    )


if __name__ == "__main__":
    main()
