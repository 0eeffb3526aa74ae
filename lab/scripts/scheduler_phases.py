"""Where the scheduler's time goes: `bench peer`'s workload run in-process, phase by phase.

The server's scheduler, engine and file store, without HTTP: ``--n`` requests of the bench's
BioASQ workload sent ``--c`` at a time (closed loop), and per phase the seconds spent in it:
decode steps alone and with a prefill chunk or a draft pass riding, the chunks and the
press computed apart (model pass, compression), prefix-hit groups, and the finisher's and
the store's threads. ``--scenario new_question`` first answers the cold requests untimed, then
times new questions over their documents. Prints one JSON object (wall, first tokens,
per-request decode rates, phases, step counts). Run it alone, on the torch threads stated:

    OMP_NUM_THREADS=2 .venv/bin/python lab/scripts/scheduler_phases.py --c 4
    OMP_NUM_THREADS=2 .venv/bin/python lab/scripts/scheduler_phases.py --scenario new_question --c 8
    OMP_NUM_THREADS=2 .venv/bin/python lab/scripts/scheduler_phases.py --types summary,list \\
        --context 2000 --c 8 --max-new-tokens 256
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

DATA = Path(__file__).resolve().parents[2].parent / "shared/data/bioasq/Task10BGoldenEnriched"


class Timings:
    """Seconds and calls per phase, from wrapped methods."""

    def __init__(self) -> None:
        self.seconds: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()

    def wrap(self, owner: Any, name: str, phase: Any) -> None:
        """Time ``owner.name`` under ``phase`` (a name, or a function of the call's arguments)."""
        real = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            key = phase(*args, **kwargs) if callable(phase) else phase
            started = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                self.seconds[key] += time.perf_counter() - started
                self.calls[key] += 1

        setattr(owner, name, timed)


class Client:
    """One request as the scheduler sees it, recording when its tokens came."""

    def __init__(self, request: Any, options: Any) -> None:
        self.question = request.question
        self.documents = list(request.documents)
        self.namespace = "default"
        self.options = options
        self.sent = time.perf_counter()
        self.token_times: list[float] = []
        self.closed = threading.Event()
        self.outcome = ""

    def is_cancelled(self) -> bool:
        return False

    def started(self) -> None:
        pass

    def emit(self, event: Any) -> None:
        from ragsnap.engine.events import TokenEvent

        if isinstance(event, TokenEvent):
            self.token_times.append(time.perf_counter() - self.sent)

    def fail(self, error: Exception) -> None:
        print(f"request failed: {error!r}")
        self.close("error")

    def close(self, outcome: str) -> None:
        self.outcome = outcome
        self.closed.set()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", choices=("cold", "new_question"), default="cold")
    parser.add_argument("--c", type=int, default=4, help="requests in flight")
    parser.add_argument("--n", type=int, default=8, help="requests")
    parser.add_argument("--context", type=int, default=3000, help="tokens of documents")
    parser.add_argument("--types", help="BioASQ question types, e.g. summary,list")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--step-tokens", type=int, default=512)
    parser.add_argument("--data", type=Path, default=DATA)
    args = parser.parse_args()

    import ragsnap.runtime.prefill as prefill_module
    import ragsnap.runtime.tails as tails_module
    from ragsnap.cli.bench.peer_workload import build_workload, load_workload_items
    from ragsnap.compression.hooks import CompressionRecorder
    from ragsnap.engine.engine import RagSnapEngine
    from ragsnap.engine.scheduler import Scheduler
    from ragsnap.runtime.generation import GenerationConfig
    from ragsnap.runtime.threads import in_a_passing_thread

    threads = torch.get_num_threads()
    scratch = tempfile.TemporaryDirectory(prefix="ragsnap-phases-")  # removed at exit
    engine = in_a_passing_thread(
        lambda: RagSnapEngine.load(cache_url=f"file://{scratch.name}", threads=threads)
    )
    types = tuple(args.types.split(",")) if args.types else None
    items = load_workload_items("bioasq", args.data, 0, args.context, engine.tokenizer, types)
    scenarios = ("cold", "new_question") if args.scenario == "new_question" else ("cold",)
    workload = build_workload(
        items,
        engine.tokenizer,
        levels=[args.c],
        prompts=args.n,
        context_tokens=args.context,
        max_prompt_tokens=8192,
        scenarios=scenarios,
    )[args.c]
    options = engine.default_options(
        document_order="given", generation=GenerationConfig(max_new_tokens=args.max_new_tokens)
    )

    def run(requests: list[Any], timings: Timings | None) -> tuple[list[Client], float]:
        scheduler = Scheduler(engine, max_batch=8, step_tokens=args.step_tokens)
        if timings is not None:
            timings.wrap(
                scheduler.batch,
                "step",
                lambda chunk=None, draft=None: (
                    "decode step with a draft pass of a prompt"
                    if chunk and chunk.queries is not None
                    else "decode step with a chunk"
                    if chunk
                    else "decode step with a draft pass"
                    if draft
                    else "decode step"
                ),
            )
            timings.wrap(scheduler, "_next_chunk", "chunk or press apart from decode")
            timings.wrap(scheduler, "_finish_prefix_hits", "prefix-hit group")
        scheduler.start()
        queue, live, done = list(requests), [], []
        started = time.perf_counter()
        while queue or live:
            while queue and len(live) < args.c:
                client = Client(queue.pop(0), options)
                live.append(client)
                scheduler.submit(client)
            for client in list(live):
                if client.closed.wait(0.005):
                    live.remove(client)
                    done.append(client)
        wall = time.perf_counter() - started
        while scheduler.pending_writes:
            time.sleep(0.05)
        scheduler.stop()
        return done, wall

    timings = Timings()
    timings.wrap(prefill_module, "forward_chunk", "  of which: a chunk's model pass")
    timings.wrap(tails_module.BatchedKV, "of_rows", "  of which: a prefix-hit group's batch")
    timings.wrap(CompressionRecorder, "compress_pending", "compression (any thread)")
    timings.wrap(engine, "finish", "finisher thread: citations, verdict")
    timings.wrap(engine, "store_pending", "store thread: entry writes")
    if args.scenario == "new_question":
        run(workload["cold"], None)
        timings.seconds.clear()
        timings.calls.clear()
    done, wall = run(workload[args.scenario], timings)
    rates = [
        (len(c.token_times) - 1) / (c.token_times[-1] - c.token_times[0])
        for c in done
        if len(c.token_times) > 1 and c.token_times[-1] > c.token_times[0]
    ]
    print(
        json.dumps(
            {
                "threads": threads,
                "dtype": str(next(engine.loaded.model.parameters()).dtype),
                "requests": len(done),
                "wall_s": round(wall, 2),
                "new_tokens": sum(len(c.token_times) for c in done),
                "first_token_s": sorted(round(c.token_times[0], 2) for c in done if c.token_times),
                "decode_tokens_per_s": sorted(round(r, 2) for r in rates),
                "phases_s": {k: round(v, 2) for k, v in timings.seconds.most_common()},
                "calls": dict(timings.calls),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
