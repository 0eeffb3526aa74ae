"""Streaming clients of ``ragsnap bench peer``: what each request took, as the client saw it.

Time to first token is the arrival of the first non-empty piece of answer text: a
``token`` event from ragsnap's ``/v1/answer``, a chunk with text from the peer's
``/v1/completions``. Token counts come from the servers (ragsnap's ``done`` statistics,
the peer's final ``usage`` chunk), and so do the prompt token counts that show both
prefilled the same prompt.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ragsnap.cli.bench.peer_workload import PeerRequest


@dataclass
class Outcome:
    """One request's result: ``ok`` False with ``error`` for a failed one."""

    request_id: str
    ok: bool = False
    ttft_s: float | None = None
    last_token_s: float | None = None  # when the last token arrived (the end of decoding)
    total_s: float = 0.0
    new_tokens: int = 0
    prompt_tokens: int | None = None
    text: str = ""
    cache: str | None = None
    error: str | None = None
    # where the server says the time went (ragsnap's `done` statistics), seconds
    server_s: dict[str, float] = field(default_factory=dict)

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first over the time from the first to the last (None for fewer
        than two): what a reader of the stream sees, not the work after its last token
        (ragsnap's citations and verdict, an OpenAI stream's usage chunk)."""
        end = self.last_token_s
        if self.ttft_s is None or end is None or self.new_tokens < 2 or end <= self.ttft_s:
            return None
        return (self.new_tokens - 1) / (end - self.ttft_s)


# the stages of a ragsnap answer that its statistics time (see ragsnap.engine.stats.AnswerStats)
SERVER_TIMES = (
    "ttft_s",
    "prefill_s",
    "compress_s",
    "cache_load_s",
    "decode_s",
    "attribution_s",
    "total_s",
)

Send = Callable[[Any, PeerRequest], Awaitable[Outcome]]


async def _sse_lines(client: Any, url: str, body: dict[str, Any], outcome: Outcome) -> Any:
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            detail = (await response.aread()).decode(errors="replace")[:300]
            outcome.error = f"HTTP {response.status_code}: {detail}"
            return
        async for line in response.aiter_lines():
            yield line


def ragsnap_sender(base_url: str, max_new_tokens: int, compression: dict[str, Any]) -> Send:
    """A sender of ``/v1/answer`` streams (``meta``, ``token``..., ``done``)."""
    url = f"{base_url.rstrip('/')}/v1/answer"

    async def send(client: Any, request: PeerRequest) -> Outcome:
        outcome = Outcome(request.id)
        started = time.perf_counter()
        event = ""
        try:
            async for line in _sse_lines(
                client, url, request.answer_body(max_new_tokens, compression), outcome
            ):
                if line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:"):
                    data = json.loads(line[5:])
                    if event == "meta":
                        outcome.prompt_tokens = int(data["prompt_tokens"])
                    elif event == "token" and data.get("text"):
                        outcome.last_token_s = time.perf_counter() - started
                        outcome.ttft_s = outcome.ttft_s or outcome.last_token_s
                    elif event == "done":
                        outcome.text = data["answer"]
                        outcome.new_tokens = int(data["stats"]["new_tokens"])
                        outcome.cache = data["stats"].get("cache")
                        outcome.server_s = {
                            k: float(data["stats"][k])
                            for k in SERVER_TIMES
                            if data["stats"].get(k) is not None
                        }
                        outcome.ok = True
                    elif event == "error":
                        outcome.error = str(data)[:300]
        except Exception as exc:  # transport errors and malformed streams end up in the report
            outcome.error = f"{type(exc).__name__}: {exc}"[:300]
        outcome.total_s = time.perf_counter() - started
        outcome.ok = outcome.ok and outcome.error is None
        return outcome

    return send


def completions_sender(base_url: str, max_new_tokens: int, stop_ids: Sequence[int]) -> Send:
    """A sender of OpenAI ``/v1/completions`` streams with token-id prompts (the peer)."""
    url = f"{base_url.rstrip('/')}/v1/completions"

    async def send(client: Any, request: PeerRequest) -> Outcome:
        outcome = Outcome(request.id)
        started = time.perf_counter()
        pieces: list[str] = []
        try:
            body = request.completion_body(max_new_tokens, stop_ids)
            async for line in _sse_lines(client, url, body, outcome):
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                chunk = json.loads(line[5:])
                for choice in chunk.get("choices") or []:
                    if choice.get("text"):
                        outcome.last_token_s = time.perf_counter() - started
                        outcome.ttft_s = outcome.ttft_s or outcome.last_token_s
                        pieces.append(choice["text"])
                usage = chunk.get("usage")
                if usage:
                    outcome.new_tokens = int(usage.get("completion_tokens") or 0)
                    outcome.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    outcome.ok = True
        except Exception as exc:
            outcome.error = f"{type(exc).__name__}: {exc}"[:300]
        outcome.total_s = time.perf_counter() - started
        outcome.text = "".join(pieces)
        outcome.ok = outcome.ok and outcome.error is None
        return outcome

    return send


async def run_scenario(
    send: Send, requests: Sequence[PeerRequest], concurrency: int, timeout_s: float
) -> tuple[list[Outcome], float]:
    """All ``requests``, at most ``concurrency`` in flight; outcomes in request order and wall seconds."""
    import httpx

    semaphore = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:

        async def one(request: PeerRequest) -> Outcome:
            async with semaphore:
                return await send(client, request)

        started = time.perf_counter()
        outcomes = await asyncio.gather(*(one(r) for r in requests))
        wall = time.perf_counter() - started
    return list(outcomes), wall
