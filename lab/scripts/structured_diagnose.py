"""Does the observation window find the asked record? SnapKV's view of structured lookups.

For each generated item (``build_structured``): the share of (layer, KV head) pairs in
which SnapKV at ``--budget`` keeps the asked key's and value's tokens, and the rank of the
asked record among all records by its best SnapKV score (0 = the window's favourite).
Prints one JSON line per item and a summary line. Example:

    OMP_NUM_THREADS=1 .venv/bin/python lab/scripts/structured_diagnose.py --lengths 1500 --samples 3
"""

from __future__ import annotations

import argparse
import json
import re
from statistics import fmean
from typing import Any

import torch

from ragsnap.compression import Press, compression_hooks, make_press
from ragsnap.compression.base import CompressedLayer, LayerContext, keep_all
from ragsnap.compression.snapkv import SnapKVPress
from ragsnap.engine.engine import RagSnapEngine
from ragsnap.eval.structured import build_structured
from ragsnap.prompt.assembly import format_document
from ragsnap.runtime.generation import GenerationConfig

KEY = re.compile(r"[a-z]+-[a-z]+-\d\d")


def _tokens(offsets: list[tuple[int, int]], start: int, header: int, lo: int, hi: int) -> list[int]:
    """Prompt positions of the tokens covering characters ``[lo, hi)`` of the document text."""
    return [start + j for j, (a, b) in enumerate(offsets) if a - header < hi and b - header > lo]


class _Scores(Press):
    """Keeps everything, remembers SnapKV's scores per layer (``[Hkv, L - w]``)."""

    name = "scores"

    def __init__(self, budget: int) -> None:
        self.snap = SnapKVPress(budget=budget)
        self.scores: dict[int, torch.Tensor] = {}

    def compress(self, layer: LayerContext) -> CompressedLayer:
        self.scores[layer.layer_idx] = self.snap.score(layer)[0]
        return keep_all(layer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1500")
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--budget", type=int, default=75)
    args = parser.parse_args()
    engine = RagSnapEngine.load("embedded", device="cpu")
    lengths = [int(x) for x in args.lengths.split(",")]
    items = build_structured(engine.tokenizer, lengths=lengths, samples=args.samples).items
    rows: list[dict[str, Any]] = []
    for item in items:
        layout = engine.build_prompt(
            item.question,
            item.documents,
            GenerationConfig(max_new_tokens=16),
            answer_prefix=item.answer_prefix,
        )
        doc = item.documents[0]
        text, start = doc.text, layout.doc_spans[0][0]
        header = len(f"[1] {doc.title}".rstrip()) + 1
        offsets = engine.tokenizer(
            format_document(1, doc),
            add_special_tokens=False,
            split_special_tokens=True,
            return_offsets_mapping=True,
        )["offset_mapping"]
        keys = list(dict.fromkeys(KEY.findall(text)))
        firsts = [text.index(k) for k in keys]
        record = torch.tensor([sum(p <= a - header for p in firsts) - 1 for a, _ in offsets])
        asked = keys.index(item.metadata["key"])
        key_lo = text.index(item.metadata["key"])
        value_lo, value_hi = item.metadata["value_span"]

        key_tokens = _tokens(offsets, start, header, key_lo, key_lo + len(keys[asked]))
        value_tokens = _tokens(offsets, start, header, value_lo, value_hi)
        recorder = _Scores(args.budget)
        snap = make_press("snapkv", budget=args.budget)
        with compression_hooks(engine.loaded.model, [recorder, snap], apply=False) as hooks:
            hooks.armed = True
            engine.forward(layout.input_ids, engine.new_cache(), 0)
            kept = hooks.layer_results(1)
        keep_rate = torch.zeros(layout.num_tokens)
        for layer in kept:
            keep_rate += torch.bincount(
                layer.indices[0].flatten(), minlength=layout.num_tokens
            ).float()
        keep_rate /= sum(layer.indices.shape[1] for layer in kept)
        ranks = []
        for scores in recorder.scores.values():
            for head in scores:
                doc_scores = head[start : start + len(record)]
                best = torch.stack(
                    [doc_scores[record[: len(doc_scores)] == r].max() for r in range(len(keys))]
                )
                ranks.append(int((best > best[asked]).sum()))
        row = {
            "item": item.id,
            "records": len(keys),
            "key_kept": round(float(keep_rate[key_tokens].mean()), 4),
            "value_kept": round(float(keep_rate[value_tokens].mean()), 4),
            "asked_rank_mean": round(fmean(ranks), 2),
            "asked_top1": round(sum(r == 0 for r in ranks) / len(ranks), 4),
        }
        rows.append(row)
        print(json.dumps(row))
    summary = {k: round(fmean(r[k] for r in rows), 4) for k in rows[0] if k != "item"}
    print(json.dumps({"summary": summary, "n": len(rows), "budget": args.budget}))


if __name__ == "__main__":
    main()
