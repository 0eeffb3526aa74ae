"""``ragsnap serve``: the HTTP service (``/v1/answer``, ``/v1/chat/completions``, health, metrics).

Every setting also reads from the environment with the ``RAGSNAP_`` prefix (see
``api/settings.py``); options given here win.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from ragsnap.cli.options import STORAGE_DTYPES
from ragsnap.cli.progress import loading_model
from ragsnap.models import MATMUL_PRECISIONS
from ragsnap.runtime.drafts import DEFAULT_SPECULATE


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve", help="run the HTTP service (streaming answers, OpenAI-compatible API, metrics)"
    )
    parser.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (default 8000)")
    parser.add_argument(
        "--model", help="'embedded' (default), a Hugging Face id, a directory or a .gguf"
    )
    parser.add_argument("--device", help="auto (default), cpu, cuda, cuda:1...")
    parser.add_argument(
        "--dtype", help="auto (default: bfloat16 on CUDA and on CPUs with AMX), float32, bfloat16"
    )
    parser.add_argument(
        "--matmul-precision",
        choices=MATMUL_PRECISIONS,
        help="float32 CPU models: medium rounds the inputs of long products to bfloat16 "
        "(default auto: medium on CPUs with AVX512-BF16)",
    )
    parser.add_argument(
        "--cache", metavar="URL", help="KV cache store: redis://..., file:///dir or none"
    )
    parser.add_argument("--corpus", metavar="DIR", help="folder the `query` field searches (BM25)")
    parser.add_argument(
        "--max-queue", type=int, help="requests allowed to wait (default 8); more get 429"
    )
    parser.add_argument(
        "--max-batch",
        type=int,
        help="most requests decoded together (default 8; 1: one at a time); with "
        "--kv-memory-gib a ceiling, memory the constraint",
    )
    parser.add_argument(
        "--storage-dtype",
        choices=STORAGE_DTYPES,
        help="dtype of stored KV entries (default auto: the model's; int8: one float32 scale "
        "per head and token; $RAGSNAP_STORAGE_DTYPE)",
    )
    parser.add_argument(
        "--kv-memory-gib",
        type=float,
        metavar="G",
        help="KV memory of running requests, in GiB: those that do not fit wait in the queue, "
        "one larger than all of it is refused ($RAGSNAP_KV_MEMORY_GIB; default: no bound)",
    )
    parser.add_argument(
        "--step-tokens",
        type=int,
        help="token budget of a scheduler step: prefill chunk + one per running request (512)",
    )
    parser.add_argument(
        "--prefill-threads",
        type=int,
        help="torch threads while a prompt prefills (default: every core the server may "
        "run on); decode steps keep --threads",
    )
    parser.add_argument(
        "--prefix-memory-mb",
        type=int,
        help="document prefixes kept in this process's memory in front of the cache store, "
        "most recently used first (default 1024; 0: off)",
    )
    parser.add_argument(
        "--hit-memory-mb",
        type=int,
        help="compressed entries kept loaded in this process's memory once read or written, "
        "most recently used first (default 256; 0: off)",
    )
    parser.add_argument(
        "--speculate",
        type=int,
        help="drafted tokens a greedy answer feeds per decode step (default "
        f"{DEFAULT_SPECULATE}; 0: off)",
    )
    parser.add_argument(
        "--commit-lookahead",
        action=argparse.BooleanOptionalAction,
        help="greedy answers start with the tokens the lookahead press drafted on the full "
        "cache, kept unchecked (default on)",
    )
    parser.add_argument(
        "--speculate-ngrams",
        action=argparse.BooleanOptionalAction,
        help="also draft what followed the answer's last tokens in the prompt or the answer "
        "(default on)",
    )
    parser.add_argument(
        "--full-prefill",
        action="store_true",
        default=None,
        help="force the full prefill path: presses that propagate (query-aware prefill) run "
        "without it ($RAGSNAP_FULL_PREFILL)",
    )
    ray = parser.add_argument_group("Ray Serve (pip install 'ragsnap[ray]')")
    ray.add_argument(
        "--ray",
        action="store_true",
        help="serve on Ray Serve: a local Ray head in this process, or the cluster at "
        "$RAY_ADDRESS; engine replicas share the --cache store (use redis://)",
    )
    ray.add_argument("--replicas", type=int, help="engine replicas with --ray (default 2)")
    ray.add_argument(
        "--ray-proxy",
        action="store_true",
        help="with a local Ray head: serve --port through Serve's HTTP proxy instead of the "
        "ingress replica's own server (direct ingress, one Ray hop less)",
    )
    ray.add_argument(
        "--replica-cpus",
        type=float,
        help="CPUs reserved per replica (default: the cluster's CPUs, less the ingress's "
        "0.25, shared by the replicas; fractions such as 0.5 work)",
    )
    ray.add_argument(
        "--replica-gpus",
        type=float,
        help="GPUs per replica (default: 1 when the cluster has GPUs, else 0)",
    )
    parser.set_defaults(handler=run)


def given_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The settings the options name (the rest comes from the environment)."""
    given = {
        "host": args.host,
        "port": args.port,
        "model": args.model,
        "device": args.device,
        "dtype": args.dtype,
        "matmul_precision": args.matmul_precision,
        "cache_url": args.cache,
        "corpus_dir": args.corpus,
        "max_queue": args.max_queue,
        "max_batch": args.max_batch,
        "kv_memory_gib": args.kv_memory_gib,
        "storage_dtype": args.storage_dtype,
        "step_tokens": args.step_tokens,
        "prefill_threads": args.prefill_threads,
        "prefix_memory_mb": args.prefix_memory_mb,
        "hit_memory_mb": args.hit_memory_mb,
        "speculate": args.speculate,
        "speculate_ngrams": args.speculate_ngrams,
        "commit_lookahead": args.commit_lookahead,
        "full_prefill": args.full_prefill,
    }
    return {k: v for k, v in given.items() if v is not None}


def settings_from_args(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """Settings from the environment, overridden by the options given."""
    from pydantic import ValidationError

    from ragsnap.api.settings import Settings
    from ragsnap.errors import ConfigError

    try:
        return Settings(**given_settings(args))
    except ValidationError as exc:
        first = exc.errors()[0]
        name = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"setting {name}: {first['msg']}", field=name) from None


def keep_threads_for_the_scheduler(settings: Any) -> Any:
    """Settings whose decode threads are this process's torch threads (unless set), after
    moving this thread (the HTTP server's) to one torch thread: on a small machine, a
    second thread computing on several would slow the scheduler's decode steps (see
    :meth:`ragsnap.scheduler.Scheduler.start`)."""
    import torch

    decode = settings.decode_threads or torch.get_num_threads()
    torch.set_num_threads(1)
    return settings.model_copy(update={"decode_threads": decode})


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from ragsnap.api.app import create_app
        from ragsnap.api.services import load_engine
    except ImportError as exc:
        from ragsnap.errors import ConfigError

        raise ConfigError(
            f"serving needs the 'serve' extra: pip install 'ragsnap[serve]' ({exc.name})"
        ) from None

    settings = settings_from_args(args)
    if getattr(args, "ray", False):
        from ragsnap.cli.serve_ray import run_on_ray

        return run_on_ray(args, settings, given_settings(args))
    logging.getLogger("ragsnap").setLevel(logging.INFO)  # the one-line-per-request access log
    settings = keep_threads_for_the_scheduler(settings)
    with loading_model(settings.model, settings.device):
        engine = load_engine(settings)  # fails here, with one clear line, before binding
    app = create_app(settings, engine=engine)
    auth = f"{len(settings.api_keys)} API key(s)" if settings.auth_enabled else "no API key"
    where = f"http://{settings.host}:{settings.port}"
    playground = f"; playground at {where}/" if settings.playground else ""
    print(
        f"ragsnap: serving {engine.loaded.model_id} at {where} ({auth}){playground}; "
        "stop with Ctrl-C",
        file=sys.stderr,
        flush=True,
    )
    from ragsnap.api.http_protocol import server_options

    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level="warning",
        access_log=False,
        **server_options(settings),
    )
    return 0
