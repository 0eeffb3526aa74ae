"""Which layers and heads kept the answer: span retention per (layer, KV head)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ragsnap.compression import Press
from ragsnap.errors import InputError
from ragsnap.prompt.assembly import (
    DEFAULT_DOCUMENT_ORDER,
    PromptLayout,
    encode_user_text_with_offsets,
    format_document,
)
from ragsnap.prompt.documents import Document
from ragsnap.prompt.order import fit_prompt
from ragsnap.runtime.generation import DEFAULT_MAX_NEW_TOKENS
from ragsnap.runtime.model_runtime import ModelRuntime
from ragsnap.runtime.prefill import PrefillResult


def answer_positions(runtime: ModelRuntime, layout: PromptLayout, answer: str) -> list[int]:
    """Prompt positions of the tokens of every occurrence of ``answer`` in the documents."""
    positions: list[int] = []
    for number, (document, (start, _)) in enumerate(
        zip(layout.documents, layout.doc_spans, strict=True), 1
    ):
        piece = format_document(number, document)
        _, offsets = encode_user_text_with_offsets(runtime.tokenizer, piece)
        begin = piece.find(answer)
        while begin >= 0:
            end = begin + len(answer)
            positions += [start + i for i, (a, b) in enumerate(offsets) if a < end and b > begin]
            begin = piece.find(answer, end)
    if not positions:
        raise InputError(f"the answer {answer!r} does not occur in the documents", field="answer")
    return sorted(set(positions))


def span_retention(result: PrefillResult, positions: Sequence[int]) -> torch.Tensor:
    """``[layers, Hkv]``: share of the span's positions each compressed layer and head kept."""
    span = torch.tensor(list(positions))
    # per layer [Hkv, n_l] kept positions -> [Hkv, |span|] membership (layers differ in n_l)
    return torch.stack(
        [
            (layer.indices[0].cpu().unsqueeze(-1) == span).any(dim=-2).float().mean(-1)
            for layer in result.kept
        ]
    )


@dataclass
class Diagnosis:
    press: str
    retention: torch.Tensor  # [layers, Hkv]
    # which prefill computed it (query-aware prefill: the split layer and tokens past it)
    prefill_path: str = "full"
    propagate_layer: int | None = None
    propagated_tokens: int | None = None

    def summary(self) -> dict[str, object]:
        return {
            "press": self.press,
            "prefill_path": self.prefill_path,
            "propagate_layer": self.propagate_layer,
            "propagated_tokens": self.propagated_tokens,
            "mean_retention": round(float(self.retention.mean()), 4),
            "heads_with_whole_span": int((self.retention == 1).sum()),
            "heads": int(self.retention.numel()),
        }


def diagnose(
    runtime: ModelRuntime,
    question: str,
    documents: Sequence[Document],
    answer: str,
    presses: Sequence[Press],
) -> tuple[list[int], list[Diagnosis]]:
    """One prefill, every press: how much of the answer span each layer and head kept."""
    layout = fit_prompt(
        runtime.tokenizer,
        runtime.loaded.context_length,
        question,
        documents,
        DEFAULT_MAX_NEW_TOKENS,
        DEFAULT_DOCUMENT_ORDER,
    )
    positions = answer_positions(runtime, layout, answer)
    results = runtime.prefill_many(layout.input_ids, presses, layout=layout)
    return positions, [
        Diagnosis(
            press=r.press_config["press"],
            retention=span_retention(r, positions),
            prefill_path=r.prefill_path,
            propagate_layer=r.propagate_layer,
            propagated_tokens=r.propagated_tokens,
        )
        for r in results
    ]


def plot_retention(diagnoses: Sequence[Diagnosis], answer: str, path: Path) -> None:
    """One heatmap per press (layers x KV heads), side by side, saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        1,
        len(diagnoses),
        figsize=(2.2 * len(diagnoses) + 1.5, 6),
        squeeze=False,
        sharey=True,
        layout="constrained",
    )
    for ax, diagnosis in zip(axes[0], diagnoses, strict=True):
        image = ax.imshow(
            diagnosis.retention.numpy(), vmin=0, vmax=1, cmap="viridis", aspect="auto"
        )
        ax.set_title(f"{diagnosis.press}\nmean {diagnosis.retention.mean():.2f}", fontsize=9)
        ax.set_xlabel("KV head")
    axes[0][0].set_ylabel("layer")
    fig.colorbar(image, ax=axes[0].tolist(), label="share of answer span kept")
    fig.suptitle(f"answer span {answer!r}", fontsize=10)
    fig.savefig(path, dpi=120)
    plt.close(fig)
