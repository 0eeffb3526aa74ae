"""One evaluation from request to files: load items, run the grid, write the results."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from ragsnap.compression.decode_snapkv import DecodeSnapKV, decode_compression
from ragsnap.eval.aggregate import build_runs
from ragsnap.eval.datasets import guess_format, load_items
from ragsnap.eval.grid import GridPoint, press_grid
from ragsnap.eval.items import LoadedItems
from ragsnap.eval.niah import build_needles
from ragsnap.eval.provenance import provenance
from ragsnap.eval.report import (
    plot_needles,
    plot_scores,
    write_malformed,
    write_metrics,
    write_report,
)
from ragsnap.eval.runner import output_dir, run_items, select_records
from ragsnap.eval.store import PredictionStore, check_settings
from ragsnap.prompt.assembly import DocumentOrder
from ragsnap.runtime.generation import GenerationConfig
from ragsnap.runtime.model_runtime import ModelRuntime

logger = logging.getLogger(__name__)

DEFAULT_MAX_NEW_TOKENS = {"niah": 16, "structured": 16, "kvretrieval": 32}  # others: 64
GENERATED = ("niah", "structured")  # formats built from settings, not read from --data


@dataclass
class EvalRequest:
    """What ``ragsnap eval`` was asked to do (paths as given; see the CLI for the meaning)."""

    out: Path
    data: Path | None = None
    format: str | None = None
    presses: list[str] = field(default_factory=lambda: ["full", "snapkv"])
    budgets: list[int] = field(default_factory=lambda: [128, 256, 512])
    ratios: list[float] | None = None  # instead of budgets: shares of the prompt kept
    # window, kernel, pooling, profile, keep_instruction (None: each press's default)
    press_options: dict[str, Any] = field(default_factory=dict)
    limit: int | None = None
    offset: int = 0
    seed: int = 0
    max_new_tokens: int | None = None
    decode_slack: int | None = None  # decode-phase SnapKV for the compressed caches
    decode_window: int | None = None
    document_order: DocumentOrder = "relevance"
    context_tokens: int | None = None
    types: list[str] | None = None
    haystack: Path | None = None
    lengths: list[int] = field(default_factory=lambda: [1000, 2000, 4000])
    depths: list[float] = field(default_factory=lambda: [0, 25, 50, 75, 100])
    samples: int = 1
    needles: Path | None = None
    structures: list[str] | None = None
    answer_prefix: bool = True
    plots: bool = True
    progress: bool = True
    command: list[str] | None = None  # the command line, for provenance (default sys.argv)

    @property
    def resolved_format(self) -> str:
        if self.format:
            return self.format
        if self.data is None and self.haystack is not None:
            return "niah"
        return guess_format(self.data) if self.data is not None else "bioasq"

    def validate(self) -> None:
        """Raise InputError / ConfigError for a request that cannot run (before any model work)."""
        from ragsnap.errors import ConfigError, InputError
        from ragsnap.eval.items import ITEM_TYPES

        fmt = self.resolved_format
        if fmt == "niah":
            if self.haystack is None or not self.haystack.is_dir():
                raise InputError(
                    "--format niah needs --haystack DIR (a folder of .txt files)", field="haystack"
                )
            if self.needles is not None and not self.needles.is_file():
                raise InputError(f"needles file not found: {self.needles}", field="needles")
            if not self.lengths or min(self.lengths) < 1:
                raise ConfigError("--lengths must be positive token counts", field="lengths")
        elif fmt == "structured":
            from ragsnap.eval.structured import STRUCTURES

            if not self.lengths or min(self.lengths) < 1:
                raise ConfigError("--lengths must be positive token counts", field="lengths")
            unknown_structures = sorted(set(self.structures or ()) - set(STRUCTURES))
            if unknown_structures:
                raise ConfigError(
                    f"unknown --structures {', '.join(unknown_structures)} "
                    f"(choose from: {', '.join(STRUCTURES)})",
                    field="structures",
                )
        elif self.data is None or not self.data.exists():
            raise InputError(
                f"--data not found: {self.data}"
                if self.data
                else f"--format {fmt} needs --data PATH",
                field="data",
            )
        unknown = sorted(set(self.types or ()) - set(ITEM_TYPES))
        if unknown:
            raise ConfigError(
                f"unknown --types {', '.join(unknown)} (choose from: {', '.join(ITEM_TYPES)})",
                field="types",
            )
        if self.limit is not None and self.limit < 1:
            raise ConfigError("--limit must be at least 1", field="limit")
        if self.samples < 1:
            raise ConfigError("--samples must be at least 1", field="samples")
        profile = self.press_options.get("profile")
        if profile not in (None, "auto", "uniform") and not Path(profile).is_file():
            raise InputError(f"--layer-profile not found: {profile}", field="layer_profile")
        self.grid()  # unknown presses, bad budgets, options no press takes
        self.decode()  # a decode window without a slack, or larger than it

    def grid(self) -> list[GridPoint]:
        return press_grid(
            self.presses, self.budgets, ratios=self.ratios, options=self.press_options
        )

    def check_data(self) -> int:
        """Parse ``--data`` with the (given or guessed) format, before any model loads:
        the number of usable items; raises InputError with the first problem when none is
        usable (a wrong ``--format`` fails here, in one line)."""
        from ragsnap.errors import InputError

        fmt = self.resolved_format
        if fmt in GENERATED or self.data is None:
            return 0
        how = f"--format {fmt}" if self.format else f"format {fmt} (guessed; give --format)"
        try:
            loaded = load_items(fmt, self.data, seed=self.seed, types=None)
        except (KeyError, TypeError, AttributeError) as exc:  # a loader surprised by the layout
            raise InputError(
                f"{self.data} does not parse as {how}: {type(exc).__name__} {exc}", field="data"
            ) from exc
        except InputError as exc:
            reason = str(exc).removeprefix(f"{self.data}: ")
            raise InputError(
                f"{self.data} does not parse as {how}: {reason}", field="data"
            ) from exc
        if not loaded.items:
            first = loaded.malformed[0] if loaded.malformed else None
            reason = f"first problem: {first.where}: {first.reason}" if first else "no items"
            raise InputError(f"{self.data} does not parse as {how}: {reason}", field="data")
        return len(loaded.items)

    def generation(self) -> GenerationConfig:
        tokens = self.max_new_tokens or DEFAULT_MAX_NEW_TOKENS.get(self.resolved_format, 64)
        return GenerationConfig(max_new_tokens=tokens, temperature=0.0)

    def decode(self) -> DecodeSnapKV | None:
        return decode_compression(self.decode_slack, self.decode_window)

    def settings(self, model_id: str) -> dict[str, Any]:
        """What the stored predictions depend on (a rerun must match these)."""
        fmt = self.resolved_format
        # needle ids name their length, depth and sample, so those may grow between runs
        keys = (
            ["seed", "answer_prefix"] if fmt in GENERATED else ["seed", "context_tokens", "types"]
        )
        values = {k: v for k, v in asdict(self).items() if k in keys}
        source = self.haystack if fmt == "niah" else None if fmt == "structured" else self.data
        return {
            "model": model_id,
            "format": fmt,
            "size": "ratio" if self.ratios else "budget",
            "press_options": {k: v for k, v in self.press_options.items() if v is not None},
            "data": str(source),
            "needles": str(self.needles),
            "max_new_tokens": self.generation().max_new_tokens,
            "document_order": self.document_order,
            **({"decode": decode.config()} if (decode := self.decode()) is not None else {}),
            **values,
        }


@dataclass
class EvalResult:
    out: Path
    runs: list[dict[str, Any]]
    evaluated: int
    resumed: int
    malformed: int
    files: list[Path]


def load_request_items(runtime: ModelRuntime, request: EvalRequest) -> LoadedItems:
    """The request's items (before ``--limit``)."""
    tokenizer = runtime.tokenizer
    fmt = request.resolved_format
    if fmt == "niah":
        from ragsnap.errors import InputError

        if request.haystack is None:
            raise InputError("--format niah needs --haystack DIR", field="haystack")
        return build_needles(
            request.haystack,
            tokenizer,
            lengths=request.lengths,
            depths=request.depths,
            samples=request.samples,
            seed=request.seed,
            needles_file=request.needles,
            answer_prefix=request.answer_prefix,
        )

    if fmt == "structured":
        from ragsnap.eval.structured import build_structured

        return build_structured(
            tokenizer,
            lengths=request.lengths,
            structures=request.structures,
            samples=request.samples,
            seed=request.seed,
            answer_prefix=request.answer_prefix,
        )

    from ragsnap.prompt.assembly import encode_user_text

    @cache
    def count_tokens(text: str) -> int:
        return len(encode_user_text(tokenizer, text))

    types = tuple(request.types) if request.types else None
    return load_items(
        fmt,
        request.data,
        seed=request.seed,
        context_tokens=request.context_tokens,
        count_tokens=count_tokens,
        types=types,
    )


def evaluate(runtime: ModelRuntime, request: EvalRequest) -> EvalResult:
    """Run ``request`` on ``runtime`` and write metrics.json, predictions.jsonl, report.md,
    malformed.json and the plots into ``request.out``."""
    request.validate()
    out = output_dir(request.out)
    grid = request.grid()
    configs = [{"press": g.press, "size": g.budget, **g.instance.config()} for g in grid]
    check_settings(
        out,
        request.settings(runtime.loaded.model_id),
        {
            "provenance": provenance(
                runtime, configs, request.command, request.press_options.get("profile")
            )
        },
    )
    loaded = load_request_items(runtime, request)
    rest = loaded.items[request.offset :]
    items = rest[: request.limit] if request.limit else rest
    store = PredictionStore(out)
    fmt = request.resolved_format
    outcome = run_items(
        runtime,
        items,
        grid,
        store,
        request.generation(),
        dataset=fmt,
        progress=request.progress,
        decode=request.decode(),
        order=request.document_order,
    )
    malformed = loaded.malformed + outcome.malformed
    records = select_records(store.records(), items, grid)
    runs = build_runs(records, [(g.press, g.budget) for g in grid])
    files = [write_metrics(out, runs)]
    write_malformed(out, malformed)
    plots: list[str] = []
    if request.plots and runs:
        plots = plot_scores(out, runs) + plot_needles(out, records)
    header = {
        "model": runtime.loaded.model_id,
        "device": str(runtime.device),
        "format": fmt,
        "data": str(request.haystack if fmt == "niah" else request.data),
        **({"structures": ", ".join(request.structures)} if request.structures else {}),
        "presses": ", ".join(dict.fromkeys(g.press for g in grid)),
        ("ratios" if request.ratios else "budgets"): ", ".join(
            map(str, request.ratios or request.budgets)
        ),
        **{k: v for k, v in request.press_options.items() if v is not None},
        "max_new_tokens": request.generation().max_new_tokens,
        "seed": request.seed,
    }
    if request.context_tokens:
        header["context_tokens"] = request.context_tokens
    if request.limit:
        header["limit"] = request.limit
    files.append(write_report(out, runs, records, header, malformed, plots))
    files += [out / "predictions.jsonl"] + [out / p for p in plots]
    return EvalResult(
        out=out,
        runs=runs,
        evaluated=outcome.evaluated,
        resumed=outcome.resumed,
        malformed=len(malformed),
        files=files,
    )
