"""``ragsnap bench load``: concurrent clients against a running ragsnap server.

A bounded run: ``--clients`` clients each send ``--requests`` streaming ``/v1/answer``
requests over the bundled sample documents, back to back. A share ``--repeat`` of the
questions come from a small fixed pool (the KV cache can serve them), the rest are new.
A 429 is counted as refused and the client waits ``Retry-After`` (at most
``--max-backoff`` seconds) before its next request.

Prints JSON: counts by status, whether any 5xx (or transport error) happened, p50/p95
time to first token and total latency as the client sees them, cache results, and
throughput (answers and generated tokens per second of wall time).

``--context N`` gives every client its own document of about ``N`` tokens instead of the
samples. ``--compare-max-batch 1,8`` starts the server itself (in this process, on
``--model``, with a fresh file cache per run) once per value and reports each run and the
ratios to the first: the serial worker against the batched one in the same run; with
``--warm`` each server first answers the same load untimed, so the timed run is all hits.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPEATED = (
    "What is the Rosetta Stone?",
    "How do honeybees tell each other where flowers are?",
    "Who discovered penicillin, and how?",
)
NEW_TEMPLATES = (
    "In one sentence, what does document {n} say about {topic}?",
    "Give fact number {n} about {topic} from the documents.",
)
TOPICS = ("the Moon", "bees", "mould", "the stone", "the sea", "flowers", "scripts", "bacteria")


@dataclass
class Outcome:
    status: int  # HTTP status; 0 for a transport error; 299 for a stream that ended in `error`
    ttft_s: float | None = None
    total_s: float = 0.0
    new_tokens: int = 0
    cache: str | None = None
    retry_after: float = 0.0


@dataclass
class LoadReport:
    outcomes: list[Outcome] = field(default_factory=list)
    wall_s: float = 0.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ragsnap.cli.options import add_dtype_option

    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    parser.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--requests", type=int, default=20, help="requests per client")
    parser.add_argument("--repeat", type=float, default=0.5, help="share of repeated questions")
    parser.add_argument(
        "--documents", type=int, default=2, help="sample documents per request (1-4)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--press", help="compression press (default: the server's)")
    parser.add_argument("--budget", type=int, help="press budget (tokens kept per KV head)")
    parser.add_argument("--max-backoff", type=float, default=1.0, help="longest wait after a 429")
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--context", type=int, help="own document of ~N tokens per client")
    parser.add_argument(
        "--compare-max-batch", help="start in-process servers with these max-batch values"
    )
    parser.add_argument("--model", default="embedded", help="model of the in-process servers")
    add_dtype_option(parser)
    parser.add_argument(
        "--warm", action="store_true", help="in-process: run the load once untimed first"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads in-process")
    parser.add_argument("--json", action="store_true", help="(output is always JSON)")


def sample_documents(count: int) -> list[dict[str, str]]:
    from ragsnap.prompt.documents import load_documents

    paths = sorted((Path(__file__).resolve().parents[2] / "samples").glob("*.md"))
    docs = load_documents(paths[: max(1, min(count, len(paths)))])
    return [{"id": d.id, "title": d.title, "text": d.text} for d in docs]


def question_plan(args: argparse.Namespace) -> list[list[str]]:
    """Each client's questions: repeated ones from a fixed pool, new ones unique in the run."""
    rng = random.Random(args.seed)
    plan = []
    for client in range(args.clients):
        questions = []
        for i in range(args.requests):
            if rng.random() < args.repeat:
                questions.append(rng.choice(REPEATED))
            else:
                template = rng.choice(NEW_TEMPLATES)
                topic = TOPICS[(client * args.requests + i) % len(TOPICS)]
                questions.append(template.format(n=client * args.requests + i + 1, topic=topic))
        plan.append(questions)
    return plan


async def one_request(
    client: Any, url: str, body: dict[str, Any], headers: dict[str, str]
) -> Outcome:
    import httpx

    started = time.perf_counter()
    outcome = Outcome(status=0)
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            outcome.status = response.status_code
            if response.status_code != 200:
                await response.aread()
                outcome.retry_after = float(response.headers.get("retry-after", 0) or 0)
            else:
                event = ""
                async for line in response.aiter_lines():
                    if line.startswith("event:"):
                        event = line[6:].strip()
                    elif line.startswith("data:"):
                        if event == "token" and outcome.ttft_s is None:
                            outcome.ttft_s = time.perf_counter() - started
                        elif event == "done":
                            stats = json.loads(line[5:])["stats"]
                            outcome.new_tokens = int(stats.get("new_tokens", 0))
                            outcome.cache = stats.get("cache")
                        elif event == "error":
                            outcome.status = 299
    except httpx.HTTPError:
        outcome.status = 0
    outcome.total_s = time.perf_counter() - started
    return outcome


def client_documents(args: argparse.Namespace, client: int) -> list[dict[str, str]]:
    if args.context is None:
        return sample_documents(args.documents)
    from ragsnap.cli.bench.decode import filler_document

    text = filler_document(args.context, seed=client)[: 4 * args.context]  # ~4 chars a token
    return [{"id": f"notes-{client}", "title": f"Town notes {client}", "text": text}]


async def run_load(args: argparse.Namespace) -> LoadReport:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url = f"{args.url.rstrip('/')}/v1/answer"
    compression = {k: v for k, v in {"press": args.press, "budget": args.budget}.items() if v}
    report = LoadReport()

    async def client_loop(index: int, questions: list[str]) -> None:
        documents = client_documents(args, index)
        async with httpx.AsyncClient(timeout=args.timeout) as client:
            for question in questions:
                body = {
                    "question": question,
                    "documents": documents,
                    "max_new_tokens": args.max_new_tokens,
                    "stream": True,
                    **({"compression": compression} if compression else {}),
                }
                outcome = await one_request(client, url, body, headers)
                report.outcomes.append(outcome)
                if outcome.status == 429:
                    await asyncio.sleep(
                        min(args.max_backoff, outcome.retry_after or args.max_backoff)
                    )

    started = time.perf_counter()
    await asyncio.gather(*(client_loop(i, q) for i, q in enumerate(question_plan(args))))
    report.wall_s = time.perf_counter() - started
    return report


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return round(ordered[rank - 1], 4)


def summarize(report: LoadReport, args: argparse.Namespace) -> dict[str, Any]:
    outcomes = report.outcomes
    by_status = Counter(str(o.status) for o in outcomes)
    answered = [o for o in outcomes if o.status == 200]
    ttfts = [o.ttft_s for o in answered if o.ttft_s is not None]
    server_errors = sum(1 for o in outcomes if o.status >= 500 or o.status in (0, 299))
    tokens = sum(o.new_tokens for o in answered)
    return {
        "url": args.url,
        "clients": args.clients,
        "requests_per_client": args.requests,
        "repeat_share": args.repeat,
        "max_new_tokens": args.max_new_tokens,
        "total_requests": len(outcomes),
        "by_status": dict(sorted(by_status.items())),
        "answered": len(answered),
        "refused_429": by_status.get("429", 0),
        "server_errors": server_errors,
        "zero_5xx": server_errors == 0,
        "all_answered_or_429": len(answered) + by_status.get("429", 0) == len(outcomes),
        "ttft_s": {"p50": percentile(ttfts, 50), "p95": percentile(ttfts, 95)},
        "latency_s": {
            "p50": percentile([o.total_s for o in answered], 50),
            "p95": percentile([o.total_s for o in answered], 95),
        },
        "cache": dict(Counter(o.cache or "none" for o in answered)),
        "wall_s": round(report.wall_s, 3),
        "answers_per_s": round(len(answered) / report.wall_s, 4) if report.wall_s else None,
        "tokens_per_s": round(tokens / report.wall_s, 3) if report.wall_s else None,
    }


def run(args: argparse.Namespace) -> int:
    from ragsnap.errors import ConfigError

    if args.clients < 1 or args.requests < 1:
        raise ConfigError("--clients and --requests must be at least 1", field="clients")
    if not 0.0 <= args.repeat <= 1.0:
        raise ConfigError("--repeat must be in [0, 1]", field="repeat")
    if args.compare_max_batch:
        return compare_max_batch(args)
    summary = summarize(asyncio.run(run_load(args)), args)
    print(json.dumps(summary, indent=2))
    return 0 if summary["zero_5xx"] and summary["all_answered_or_429"] else 1


def compare_max_batch(args: argparse.Namespace) -> int:
    """One in-process server per ``--compare-max-batch`` value, the same load on each."""
    import tempfile

    import torch

    from ragsnap.api.app import create_app
    from ragsnap.api.local_server import running_server
    from ragsnap.api.settings import Settings
    from ragsnap.cache import open_store
    from ragsnap.engine.engine import RagSnapEngine
    from ragsnap.errors import ConfigError

    try:
        values = [int(v) for v in args.compare_max_batch.split(",")]
    except ValueError:
        raise ConfigError(
            f"--compare-max-batch: not integers: {args.compare_max_batch!r}"
        ) from None
    torch.set_num_threads(args.threads)
    runs: dict[str, dict[str, Any]] = {}
    engine = RagSnapEngine.load(
        args.model, device="cpu", dtype=args.dtype, matmul_precision=args.matmul_precision
    )
    for value in values:
        with tempfile.TemporaryDirectory() as folder:
            engine = RagSnapEngine(engine.loaded, store=open_store(f"file://{folder}"))
            settings = Settings(
                max_batch=value, max_queue=max(8, args.clients), max_new_tokens_limit=4096
            )
            with running_server(create_app(settings, engine=engine)) as url:
                args.url = url
                if args.warm:  # the timed run then finds every prompt in the cache
                    asyncio.run(run_load(args))
                runs[str(value)] = summarize(asyncio.run(run_load(args)), args)
    base = runs[str(values[0])]
    ratios = {
        key: {
            "answers_per_s": _ratio(run["answers_per_s"], base["answers_per_s"]),
            "ttft_p95": _ratio(run["ttft_s"]["p95"], base["ttft_s"]["p95"]),
        }
        for key, run in runs.items()
    }
    print(json.dumps({"threads": args.threads, "runs": runs, "ratio_to_first": ratios}, indent=2))
    return 0 if all(r["zero_5xx"] for r in runs.values()) else 1


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None
