"""Ablation: role shares of ``ragsnap-roles`` on generated structured lookups.

Runs ``ragsnap eval``'s loop with one extra grid point per share setting and prints the
mean KL and the asked value's kept share per setting and budget (JSON lines). Example:

    OMP_NUM_THREADS=1 .venv/bin/python lab/scripts/role_shares.py --lengths 1500 --samples 3 \\
        --budget 75,150 --out runs/role-shares
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from statistics import fmean, median

from ragsnap.compression import make_press
from ragsnap.engine.engine import RagSnapEngine
from ragsnap.eval.runner import GridPoint, run_items
from ragsnap.eval.store import PredictionStore
from ragsnap.eval.structured import build_structured
from ragsnap.runtime.generation import GenerationConfig

SETTINGS = {
    "ragsnap": {},
    "roles-k0.10": {"key_share": 0.10},  # the defaults
    "roles-k0.00": {"key_share": 0.0},
    "roles-k0.20": {"key_share": 0.20},
    "roles-v0.50": {"value_share": 0.50, "delim_share": 0.30, "key_share": 0.10},
    "roles-reach8": {"reach_back": 8},
    "roles-reach16": {"reach_back": 16},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1500")
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--budget", default="75,150")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    engine = RagSnapEngine.load("embedded", device="cpu")
    lengths = [int(x) for x in args.lengths.split(",")]
    budgets = [int(x) for x in args.budget.split(",")]
    items = build_structured(engine.tokenizer, lengths=lengths, samples=args.samples).items
    grid = [GridPoint("full", None, make_press("full"))]
    for label, shares in SETTINGS.items():
        name = "ragsnap" if label == "ragsnap" else "ragsnap-roles"
        grid += [GridPoint(label, b, make_press(name, budget=b, **shares)) for b in budgets]
    args.out.mkdir(parents=True, exist_ok=True)
    store = PredictionStore(args.out)
    generation = GenerationConfig(max_new_tokens=16, temperature=0.0)
    run_items(engine, items, grid, store, generation, dataset="structured", progress=False)
    records = store.records()
    for point in grid[1:]:
        rows = [r for r in records if (r["press"], r["budget"]) == (point.press, point.budget)]
        kl = [r["scores"]["kl"] for r in rows]
        kept = [r["scores"]["needle_kept_share"] for r in rows]
        summary = {"setting": point.press, "budget": point.budget, "n": len(rows)}
        summary |= {"kl_mean": round(fmean(kl), 4), "kl_median": round(median(kl), 4)}
        summary |= {"value_kept": round(fmean(kept), 4)}
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
