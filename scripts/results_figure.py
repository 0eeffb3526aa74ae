"""Draw docs/results.png from the figures docs/results.md states (no model runs).

    .venv/bin/python scripts/results_figure.py docs/results.png

Left: fidelity against SnapKV at equal budget (mean teacher-forced KL to the full cache,
n = 30 per set, the ``ragsnap eval`` runs of docs/results.md). Right: ragsnap's answers/s
as a multiple of vLLM's on the same CPU (``ragsnap bench peer``, two runs each).
"""

from __future__ import annotations

import sys
from pathlib import Path

BUDGETS = (128, 256, 512)
# mean KL(full || compressed), n = 30 items per set (docs/results.md, "Compression quality")
KL = {
    "HotpotQA": {"snapkv": (0.288, 0.144, 0.066), "ragsnap": (0.127, 0.056, 0.011)},
    "BioASQ factoid": {"snapkv": (0.383, 0.203, 0.094), "ragsnap": (0.165, 0.075, 0.022)},
}
# ragsnap / vLLM answers/s, run 1 and run 2 (docs/results.md, "Serving against vLLM")
PEER = {
    "cold": {4: (0.60, 0.63), 8: (0.67, 0.69)},
    "repeated": {4: (2.07, 2.37), 8: (2.17, 2.33)},
    "new question": {4: (0.73, 0.89), 8: (0.92, 0.83)},
}


def main(out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4), dpi=90)
    for (name, presses), marker in zip(KL.items(), ("o", "s"), strict=True):
        left.plot(
            BUDGETS, presses["snapkv"], marker=marker, color="tab:gray", label=f"SnapKV, {name}"
        )
        left.plot(
            BUDGETS, presses["ragsnap"], marker=marker, color="tab:blue", label=f"ragsnap, {name}"
        )
    left.set_xscale("log", base=2)
    left.set_xticks(BUDGETS, [str(b) for b in BUDGETS])
    left.set_xlabel("budget (KV entries kept per head)")
    left.set_ylabel("mean KL to the full cache (nats)")
    left.set_title("Fidelity at equal budget (lower is better)", fontsize=10)
    left.legend(fontsize=7)

    width = 0.35
    for i, concurrency in enumerate((4, 8)):
        xs = [j + (i - 0.5) * width for j in range(len(PEER))]
        means = [sum(runs[concurrency]) / 2 for runs in PEER.values()]
        right.bar(
            xs, means, width, label=f"{concurrency} concurrent", color=("tab:blue", "tab:cyan")[i]
        )
        for x, runs in zip(xs, PEER.values(), strict=True):
            right.plot([x, x], runs[concurrency], "k.", markersize=4)
    right.axhline(1.0, color="black", linewidth=0.8)
    right.set_xticks(range(len(PEER)), list(PEER))
    right.set_ylabel("ragsnap answers/s / vLLM's")
    right.set_title("Against vLLM on the same 2-core CPU", fontsize=10)
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/results.png"))
