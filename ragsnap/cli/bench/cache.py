"""``ragsnap bench cache``: time to first token for a cold miss, a full hit and a prefix hit.

Each repetition uses a fresh namespace in the store, so its miss is cold:

1. miss        question A over the documents: prefill, compress, store both tiers;
2. hit         question A again: load the compressed KV, no prefill;
3. prefix hit  question B over the same documents: load the document prefix, prefill B;
4. read floor  read the compressed entry from the store and deserialize it, nothing else.

Medians over repetitions are reported with the stored bytes of each tier and the full KV
of the whole prompt. ``--storage-dtype`` also measures what storing in a smaller dtype
costs in precision (KV error against a cold prefill, and whether the answer changes).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
import uuid
from dataclasses import replace
from importlib import resources
from typing import TYPE_CHECKING, Any

import torch

from ragsnap.cli.options import add_dtype_option
from ragsnap.cli.progress import loading_model
from ragsnap.errors import ConfigError

if TYPE_CHECKING:
    from ragsnap.runtime.model_runtime import ModelRuntime

logger = logging.getLogger(__name__)

QUESTION_A = "What causes the tides, according to the documents?"
QUESTION_B = "Who discovered penicillin, according to the documents?"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--context", type=int, default=4096, help="prompt length in tokens")
    parser.add_argument("--budget", type=int, default=512, help="tokens kept per KV head")
    parser.add_argument("--press", default="snapkv", help="the press (default snapkv)")
    parser.add_argument("--window", type=int, help="observation window of the press")
    parser.add_argument(
        "--cache",
        metavar="URL",
        help="store to measure: redis://..., file://DIR (default: a temporary file store)",
    )
    parser.add_argument("--storage-dtype", help="store KV in this dtype, e.g. bfloat16")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions; medians are reported")
    parser.add_argument(
        "--model", default="embedded", help="'embedded', a Hugging Face id or a path"
    )
    add_dtype_option(parser)
    parser.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda...")
    # --threads is a common option of every ragsnap command (ragsnap.cli)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def sample_documents(tokenizer: Any, context: int) -> list[Any]:
    """The bundled samples, repeated as numbered parts (the last one cut), filling about
    ``context`` prompt tokens."""
    from ragsnap.prompt.assembly import assemble_prompt, encode_user_text, format_document
    from ragsnap.prompt.documents import Document

    def count(index: int, doc: Document) -> int:
        piece = format_document(index, doc)
        return len(encode_user_text(tokenizer, piece))

    texts = []
    for entry in sorted(resources.files("ragsnap.samples").iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".md"):
            text = entry.read_text(encoding="utf-8").strip()
            texts.append((entry.name.removesuffix(".md"), text))
    # what the template, the question and the generation prompt take
    frame = max(
        assemble_prompt(tokenizer, q, [], max_prompt_tokens=context).num_tokens
        for q in (QUESTION_A, QUESTION_B)
    )
    room = context - frame
    documents: list[Document] = []
    used = 0
    while True:
        n = len(documents)
        name, text = texts[n % len(texts)]
        doc = Document(id=f"{name}-{n}", title=f"{name} part {n + 1}", text=text)
        size = count(n + 1, doc)
        if used + size > room:
            break
        documents.append(doc)
        used += size
    ids = encode_user_text(tokenizer, text)
    keep = room - used - (size - len(ids))  # what fits of the next text, its header aside
    while keep > 16:
        cut = tokenizer.decode(ids[:keep])
        doc = Document(id=f"{name}-{n}", title=f"{name} part {n + 1}", text=cut)
        if used + count(n + 1, doc) <= room:
            documents.append(doc)
            break
        keep -= 4
    return documents


def _ttft(engine: Any, question: str, documents: list[Any], options: Any, namespace: str) -> Any:
    from ragsnap.engine.events import DoneEvent

    done = None
    for event in engine.stream(question, documents, options, namespace=namespace):
        if isinstance(event, DoneEvent):
            done = event
    assert done is not None
    return done.stats


def run(args: argparse.Namespace) -> int:
    from ragsnap.cache import open_store
    from ragsnap.cache.serialization import deserialize_prefill, parse_dtype
    from ragsnap.compression import make_press
    from ragsnap.engine.engine import AnswerOptions, RagSnapEngine
    from ragsnap.runtime.generation import GenerationConfig

    if args.repeats < 1 or args.context < 256 or args.budget < 1:
        raise ConfigError("need --repeats >= 1, --context >= 256 and --budget >= 1")
    try:
        storage_dtype = parse_dtype(args.storage_dtype)
    except ValueError as exc:
        raise ConfigError(str(exc), field="storage_dtype") from exc
    if args.threads is not None:
        if args.threads < 1:
            raise ConfigError("--threads must be at least 1", field="threads")
        torch.set_num_threads(args.threads)
    with loading_model(args.model, args.device):
        base = RagSnapEngine.load(
            args.model,
            device=args.device,
            dtype=args.dtype,
            matmul_precision=args.matmul_precision,
            cache_url="none",  # the bench's own store below
        )
    scratch = None if args.cache else tempfile.TemporaryDirectory(prefix="ragsnap-bench-cache-")
    store = open_store(args.cache or f"file://{scratch.name}")  # type: ignore[union-attr]
    # every hit reads the store: its entries are what this bench measures, not a loaded copy
    # (and the miss writes its prefix entry, which it measures too)
    stored_as = str(storage_dtype).removeprefix("torch.") if storage_dtype else "auto"
    engine = RagSnapEngine(
        base.loaded,
        store,
        base.config,
        storage_dtype=stored_as,
        hit_memory_mb=0,
        prefix_store="always",
    )
    if engine.tiers is None:
        raise ConfigError("bench cache needs a store, not 'none'", field="cache")
    press = make_press(args.press, budget=args.budget, window=args.window)
    # the given order: question B meets question A's document prefix
    options = AnswerOptions(
        press=press, generation=GenerationConfig(max_new_tokens=1), document_order="given"
    )
    documents = sample_documents(base.tokenizer, args.context)
    rows: list[dict[str, float]] = []
    sizes: dict[str, int] = {}
    prompt_tokens = 0
    for rep in range(args.repeats):
        namespace = f"bench-{uuid.uuid4().hex[:12]}"
        try:
            miss = _ttft(engine, QUESTION_A, documents, options, namespace)
            hit = _ttft(engine, QUESTION_A, documents, options, namespace)
            prefix = _ttft(engine, QUESTION_B, documents, options, namespace)
            statuses = (miss.cache, hit.cache, prefix.cache)
            if statuses != ("miss", "hit", "prefix-hit"):
                raise ConfigError(f"the store did not cache as expected: {statuses}", field="cache")
            layout = engine.build_prompt(QUESTION_A, documents, options.generation, order="given")
            ckey, pkey = engine.tiers.entry_keys(layout, press.config(), QUESTION_A, namespace)
            started = time.perf_counter()
            payload = store.get(ckey)
            assert payload is not None
            deserialize_prefill(
                payload,
                model_id=base.loaded.model_id,
                revision=base.loaded.revision,
                device=base.loaded.device,
            )
            if base.loaded.device.type == "cuda":
                torch.cuda.synchronize(base.loaded.device)
            floor = time.perf_counter() - started
            started = time.perf_counter()
            prefix_payload = store.get(pkey)
            prefix_read = time.perf_counter() - started
            sizes = {
                "bytes_compressed": len(payload),
                "bytes_prefix": len(prefix_payload or b""),
                "bytes_full_kv": miss.kv_bytes_full,
                "kv_bytes_kept": miss.kv_bytes_kept,
            }
            prompt_tokens = miss.prompt_tokens
            rows.append(
                {
                    "ttft_miss_s": miss.ttft_s,
                    "ttft_hit_s": hit.ttft_s,
                    "ttft_prefix_hit_s": prefix.ttft_s,
                    "read_floor_s": floor,
                    "hit_load_s": hit.cache_load_s,
                    "prefix_read_s": prefix_read,
                    "prefix_hit_prefill_tokens": prefix.prefill_tokens,
                }
            )
            logger.info("repetition %d: %s", rep + 1, rows[-1])
        finally:
            store.clear(namespace)
    med = {name: statistics.median(r[name] for r in rows) for name in rows[0]}
    expected = args.budget / prompt_tokens * sizes["bytes_full_kv"]
    result: dict[str, Any] = {
        "context": args.context,
        "budget": args.budget,
        "ttft_miss_s": round(med["ttft_miss_s"], 4),
        "ttft_hit_s": round(med["ttft_hit_s"], 4),
        "ttft_prefix_hit_s": round(med["ttft_prefix_hit_s"], 4),
        "read_floor_s": round(med["read_floor_s"], 4),
        **{k: sizes[k] for k in ("bytes_compressed", "bytes_prefix", "bytes_full_kv")},
        "prompt_tokens": prompt_tokens,
        "store": store.describe(),
        "device": str(base.loaded.device),
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "hit_load_s": round(med["hit_load_s"], 4),
        "prefix_read_s": round(med["prefix_read_s"], 4),
        "prefix_hit_prefill_tokens": int(med["prefix_hit_prefill_tokens"]),
        "miss_over_hit": round(med["ttft_miss_s"] / med["ttft_hit_s"], 1),
        "miss_over_prefix_hit": round(med["ttft_miss_s"] / med["ttft_prefix_hit_s"], 1),
        "hit_over_floor": round(med["ttft_hit_s"] / med["read_floor_s"], 2),
        "compressed_over_expected": round(sizes["bytes_compressed"] / expected, 4),
    }
    if storage_dtype is not None:
        from ragsnap.engine.loading import runtime_for

        # the exact prefill comes from a plain runtime on the same model and settings
        runtime = runtime_for(base.loaded, base.config)
        result.update(_precision(runtime, base, engine, documents, options, press))
    store.close()
    if scratch is not None:
        scratch.cleanup()
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for name, value in result.items():
            print(f"{name:>28}: {value}")
    return 0


def _precision(
    runtime: ModelRuntime,
    base: Any,
    engine: Any,
    documents: list[Any],
    options: Any,
    press: Any,
) -> dict[str, Any]:
    """KV error and answer agreement of entries stored in the smaller dtype: ``runtime``
    prefills the exact entries, ``base`` (an engine without tiers) answers cold."""

    from ragsnap.runtime.generation import GenerationConfig

    longer = replace(options, generation=GenerationConfig(max_new_tokens=24))
    namespace = f"bench-{uuid.uuid4().hex[:12]}"
    try:
        layout = engine.build_prompt(QUESTION_A, documents, longer.generation, order="given")
        exact = runtime.prefill(layout.input_ids, press)
        _, stored = engine.prefill(layout, press, QUESTION_A, namespace)
        engine.tiers.finish(stored)  # written now: the next prefill reads the store
        loaded, report = engine.prefill(layout, press, QUESTION_A, namespace)
        assert report.status == "hit"
        errors = [
            (a.keys - b.keys).abs().max().item()
            for a, b in zip(exact.cache.layers, loaded.cache.layers, strict=True)
        ]
        scale = max(layer.keys.abs().max().item() for layer in exact.cache.layers)
        cold = base.answer(QUESTION_A, documents, longer).answer
        hit = [e for e in engine.stream(QUESTION_A, documents, longer, namespace=namespace)][-1]
    finally:
        engine.store.clear(namespace)
    return {
        "storage_dtype": str(engine.tiers.storage_dtype).removeprefix("torch."),
        "kv_max_abs_err": round(max(errors), 6),
        "kv_max_abs": round(scale, 3),
        "answer_matches_full_precision": hit.answer == cold,
    }
