"""``ragsnap bench overhead``: what Ray Serve adds per request and per streamed token.

One run starts the in-process server and the Ray Serve application (one engine replica,
a local Ray head with direct ingress, :mod:`ragsnap.api.ray_head_env`) on the same model and
the same file KV store, warms the cache, then alternates identical requests between the
in-process server, the ingress replica's own port (``ray``) and Serve's HTTP proxy
(``ray_proxy``, one Ray hop more), so all see the same machine noise and answer from cache
hits (no prefill in the timings). Reported, in milliseconds, for ``ray`` (and under
``via_proxy`` for ``ray_proxy``):

- ``per_request_ms``: latency of a whole (non-streamed) one-token answer, Ray minus
  in-process (the median of the differences within a round: both see the same moment's
  machine);
- ``per_chunk_ms``: the streamed answer of ``--tokens`` tokens, Ray minus in-process,
  less the same difference for a one-token stream, divided by the extra tokens;
- ``decode_ms_per_token``: the engines' own decode speed in the long streams (their
  ``done`` statistics): a Ray replica that decodes slower than the in-process engine (CPU
  contention on a small machine) shows in ``per_chunk_ms`` though no message is late;
- ``per_chunk_ms_90``: a 90% bootstrap interval of ``per_chunk_ms`` over the rounds (on a
  2-core machine the rounds of a multi-second stream spread by tens of ms, so one run's
  ``per_chunk_ms`` alone does not say whether a 1 ms target holds).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Any

DOCS = [
    {"id": "tides", "title": "Tides", "text": "Tides are caused mostly by the gravity of the Moon."}
]
PRESS = {"press": "snapkv", "budget": 48, "window": 8}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="embedded", help="model of both servers")
    parser.add_argument("--rounds", type=int, default=20, help="timed requests of each kind")
    parser.add_argument("--tokens", type=int, default=32, help="tokens of the long stream")
    parser.add_argument("--replica-cpus", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per engine")


def _time(url: str, body: dict[str, Any]) -> tuple[float, int, float | None]:
    """Seconds until the whole answer (or the stream's end) arrived, its tokens, and the
    engine's decode milliseconds per token."""
    import httpx

    start = time.perf_counter()
    if body.get("stream"):
        tokens, stats, event = 0, {}, ""
        with httpx.stream("POST", f"{url}/v1/answer", json=body, timeout=300) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if line.startswith("event: "):
                    event = line[len("event: ") :]
                    tokens += event == "token"
                elif line.startswith("data: ") and event == "done":
                    stats = json.loads(line[len("data: ") :])["stats"]
        return time.perf_counter() - start, tokens, stats.get("decode_ms_per_token")
    response = httpx.post(f"{url}/v1/answer", json=body, timeout=300)
    response.raise_for_status()
    stats = response.json()["stats"]
    return time.perf_counter() - start, int(stats["new_tokens"]), stats["decode_ms_per_token"]


def _medians(urls: dict[str, str], body: dict[str, Any], rounds: int) -> dict[str, Any]:
    times: dict[str, list[float]] = {name: [] for name in urls}
    decode: dict[str, list[float]] = {name: [] for name in urls}
    tokens: dict[str, int] = {}
    for url in urls.values():  # warm: the answer is then a cache hit on both
        _time(url, body)
    for _ in range(rounds):
        for name, url in urls.items():
            elapsed, tokens[name], ms = _time(url, body)
            times[name].append(elapsed)
            if ms is not None:
                decode[name].append(ms)
    first = next(iter(urls))
    # per round, each path's time minus the first path's: paired, so a slow moment of the
    # machine cancels out
    gaps = {
        name: [a - b for a, b in zip(t, times[first], strict=True)] for name, t in times.items()
    }
    summary: dict[str, Any] = {
        "median_s": {name: round(statistics.median(t), 5) for name, t in times.items()},
        "median_gap_s": {name: round(statistics.median(g), 5) for name, g in gaps.items()},
        "gaps_s": gaps,
        "tokens": tokens,
    }
    if all(decode.values()):  # one-token answers have no decode speed
        summary["decode_ms_per_token"] = {
            name: round(statistics.median(ms), 2) for name, ms in decode.items()
        }
    return summary


def run(args: argparse.Namespace) -> int:
    from ragsnap.api.ray_head_env import environment, local_head_env

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    direct_port = _free_port()
    # before Ray is imported: its Serve constants are read at import, in every process
    with environment(local_head_env(direct_port)):
        import ray
        from ray import serve

        ray.init(include_dashboard=False, log_to_driver=False)
    try:
        return _measure(args, serve, direct_port)
    finally:
        # Ray reports the shutdown of its actors on stdout: keep the JSON alone there
        with contextlib.redirect_stdout(sys.stderr):
            serve.shutdown()
            ray.shutdown()


def _measure(args: argparse.Namespace, serve: Any, direct_port: int) -> int:
    import torch

    from ragsnap.api.app import create_app
    from ragsnap.api.local_server import running_server
    from ragsnap.api.ray_app import RayAppArgs, build_app
    from ragsnap.api.services import load_engine
    from ragsnap.api.settings import Settings

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as folder:
        overrides = {"model": args.model, "device": "cpu", "cache_url": f"file://{folder}"}
        overrides["max_new_tokens_limit"] = max(512, args.tokens)
        settings = Settings(**overrides)
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app_args = RayAppArgs(replicas=1, replica_cpus=args.replica_cpus, settings=overrides)
        serve.run(build_app(app_args), name="overhead", route_prefix="/")
        ray_url, proxy_url = f"http://127.0.0.1:{direct_port}", f"http://127.0.0.1:{port}"
        _wait_ready(ray_url)
        _wait_ready(proxy_url)
        with running_server(create_app(settings, engine=load_engine(settings))) as local:
            urls = {"in_process": local, "ray": ray_url, "ray_proxy": proxy_url}
            # instructions of its own: the long stream runs to --tokens (under the default
            # "Answer in a few words." the embedded model stops after ~7 tokens)
            one = {
                "question": "What causes tides?",
                "instructions": "Write a long, detailed answer.",
                "documents": DOCS,
                "compression": PRESS,
            }
            whole = _medians(urls, {**one, "max_new_tokens": 1}, args.rounds)
            short = _medians(urls, {**one, "max_new_tokens": 1, "stream": True}, args.rounds)
            long = _medians(
                urls, {**one, "max_new_tokens": args.tokens, "stream": True}, args.rounds
            )
    print(json.dumps(summarize(args, whole, short, long), indent=2))
    return 0


def summarize(
    args: argparse.Namespace, whole: dict[str, Any], short: dict[str, Any], long: dict[str, Any]
) -> dict[str, Any]:
    def gap(run: dict[str, Any], path: str) -> float:
        return float(run["median_gap_s"][path])

    def added(path: str) -> dict[str, Any]:
        extra_tokens = max(1, long["tokens"][path] - short["tokens"][path])
        low, high = chunk_interval(long["gaps_s"][path], short["gaps_s"][path], extra_tokens)
        return {
            "per_request_ms": round(gap(whole, path) * 1000, 2),
            "per_chunk_ms": round((gap(long, path) - gap(short, path)) * 1000 / extra_tokens, 3),
            "per_chunk_ms_90": [round(low, 3), round(high, 3)],
        }

    return {
        "model": args.model,
        "rounds": args.rounds,
        "cpus": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        **added("ray"),
        "decode_ms_per_token": long.get("decode_ms_per_token", {}),
        "via_proxy": added("ray_proxy"),
        "whole_one_token": whole,
        "stream_one_token": short,
        "stream_long": long,
    }


def chunk_interval(
    long_gaps: list[float], short_gaps: list[float], extra_tokens: int, resamples: int = 2000
) -> tuple[float, float]:
    """A 90% bootstrap interval of the per-chunk figure, in ms: the rounds of the long and
    the one-token streams resampled (each with replacement, seeded), the median gap of
    each taken, their difference over ``extra_tokens``. Wider than the target means one
    run cannot tell whether the target holds."""
    rng = random.Random(0)
    values = sorted(
        (
            statistics.median(rng.choices(long_gaps, k=len(long_gaps)))
            - statistics.median(rng.choices(short_gaps, k=len(short_gaps)))
        )
        * 1000
        / extra_tokens
        for _ in range(resamples)
    )
    return values[int(0.05 * resamples)], values[int(0.95 * resamples) - 1]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_ready(url: str, timeout: float = 600.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/readyz", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the Ray Serve application did not become ready")
