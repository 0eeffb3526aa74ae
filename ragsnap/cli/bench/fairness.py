"""``ragsnap bench fairness``: how long a small request waits behind a long prompt.

For each ``--long-tokens`` value, an in-process server (``--model``, no KV cache, so every
prompt is a cold prefill) gets one long streaming request; ``--delay`` seconds later a
small one (``--short-tokens``) arrives. Reported per run: the small request's time to
first token as its client sees it, its wait in the queue (from accepted to started, the
server's ``ragsnap_queue_wait_seconds``), the long request's first token, and the small
one alone on the same server first (its cost without a queue). Prints JSON; the small request's added wait should not grow
with the long prompt's length.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ragsnap.cli.options import add_dtype_option

    parser.add_argument("--long-tokens", default="4000,8000", help="comma-separated lengths")
    parser.add_argument("--short-tokens", type=int, default=200)
    parser.add_argument("--delay", type=float, default=1.0, help="seconds between the two")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--model", default="embedded")
    add_dtype_option(parser)


def _body(tokens: int, seed: int, max_new_tokens: int) -> dict[str, Any]:
    from ragsnap.cli.bench.decode import filler_document

    text = filler_document(tokens, seed=seed)[: 4 * tokens]  # ~4 characters a token
    return {
        "question": "What do the notes say about the harbour?",
        "documents": [{"id": f"notes-{seed}", "title": "Town notes", "text": text}],
        "max_new_tokens": max_new_tokens,
        "temperature": 0,
        "stream": True,
    }


async def _pair(url: str, args: argparse.Namespace, long_tokens: int, seed: int) -> dict:
    import httpx

    from ragsnap.cli.bench.load import one_request

    endpoint = f"{url}/v1/answer"
    async with httpx.AsyncClient(timeout=600) as client:
        for attempt in range(2):  # the first warms the server up
            alone = await one_request(
                client, endpoint, _body(args.short_tokens, seed + attempt, args.max_new_tokens), {}
            )
        long_task = asyncio.create_task(
            one_request(client, endpoint, _body(long_tokens, seed + 2, args.max_new_tokens), {})
        )
        await asyncio.sleep(args.delay)
        waited_before = await _queue_wait_sum(client, url)
        short = await one_request(
            client, endpoint, _body(args.short_tokens, seed + 3, args.max_new_tokens), {}
        )
        waited = await _queue_wait_sum(client, url) - waited_before
        long = await long_task
    return {
        "long_tokens": long_tokens,
        "short_alone_ttft_s": _round(alone.ttft_s),
        "short_behind_long_ttft_s": _round(short.ttft_s),
        "short_added_wait_s": _round(
            short.ttft_s - alone.ttft_s if short.ttft_s and alone.ttft_s else None
        ),
        "short_queue_wait_s": _round(waited),  # from /metrics: accepted -> started
        "long_ttft_s": _round(long.ttft_s),
        "statuses": [alone.status, long.status, short.status],
    }


async def _queue_wait_sum(client: Any, url: str) -> float:
    """The server's total queue wait so far (``ragsnap_queue_wait_seconds_sum``)."""
    text = (await client.get(f"{url}/metrics")).text
    for line in text.splitlines():
        if line.startswith("ragsnap_queue_wait_seconds_sum "):
            return float(line.split()[1])
    return 0.0


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def run(args: argparse.Namespace) -> int:
    import torch

    from ragsnap.api.app import create_app
    from ragsnap.api.local_server import running_server
    from ragsnap.api.settings import Settings
    from ragsnap.engine.engine import RagSnapEngine
    from ragsnap.errors import ConfigError

    try:
        lengths = [int(v) for v in args.long_tokens.split(",")]
    except ValueError:
        raise ConfigError(f"--long-tokens: not integers: {args.long_tokens!r}") from None
    torch.set_num_threads(args.threads)
    engine = RagSnapEngine.load(args.model, device="cpu", dtype=args.dtype)
    settings = Settings(
        max_prompt_tokens=max(lengths) + 512,
        max_document_tokens=max(lengths) + 512,
        max_document_bytes=8 * max(lengths),
        max_total_bytes=16 * max(lengths),
    )
    runs = []
    with running_server(create_app(settings, engine=engine)) as url:
        for i, length in enumerate(lengths):
            runs.append(asyncio.run(_pair(url, args, length, seed=10 * i)))
    print(json.dumps({"threads": args.threads, "runs": runs}, indent=2))
    return 0 if all(s == 200 for r in runs for s in r["statuses"]) else 1
