"""``ragsnap serve``: the HTTP service (``/v1/answer``, ``/v1/chat/completions``, health, metrics).

Every setting also reads from the environment with the ``RAGSNAP_`` prefix (see
``api/settings.py``); options given here win.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from ragsnap.cli.progress import loading_model
from ragsnap.engine.options import (
    CACHE_FIELDS,
    DECODE_FIELDS,
    MODEL_FIELDS,
    SERVED_FIELDS,
    add_config_options,
    config_from_args,
    given_fields,
)

# the server's queue and scheduler settings (flags from api.settings.Settings)
QUEUE_FIELDS = ("max_queue", "max_batch", "kv_memory_gib", "step_tokens", "prefill_threads")


def register(subparsers: argparse._SubParsersAction) -> None:
    from ragsnap.api.settings import Settings

    parser = subparsers.add_parser(
        "serve", help="run the HTTP service (streaming answers, OpenAI-compatible API, metrics)"
    )
    parser.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (default 8000)")
    add_config_options(parser, (*MODEL_FIELDS, *CACHE_FIELDS, *DECODE_FIELDS, *SERVED_FIELDS))
    parser.add_argument(
        "--corpus",
        dest="corpus_dir",
        metavar="DIR",
        help="folder the `query` field searches (BM25)",
    )
    add_config_options(parser, QUEUE_FIELDS, config=Settings)
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


def settings_from_args(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """Settings from the options given, over ``RAGSNAP_*`` and the defaults."""
    from ragsnap.api.settings import Settings

    return config_from_args(args, Settings)


def keep_threads_for_the_scheduler(settings: Any) -> Any:
    """Settings whose decode threads are this process's torch threads (unless set), after
    moving this thread (the HTTP server's) to one torch thread: on a small machine, a
    second thread computing on several would slow the scheduler's decode steps (see
    :meth:`ragsnap.engine.scheduler.Scheduler.start`)."""
    import torch

    decode = settings.decode_threads or torch.get_num_threads()
    torch.set_num_threads(1)
    return settings.model_copy(update={"decode_threads": decode})


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from ragsnap.api.app import create_app
        from ragsnap.api.services import load_engine
        from ragsnap.runtime.threads import in_a_passing_thread
    except ImportError as exc:
        from ragsnap.errors import ConfigError

        raise ConfigError(
            f"serving needs the 'serve' extra: pip install 'ragsnap[serve]' ({exc.name})"
        ) from None

    settings = settings_from_args(args)
    if getattr(args, "ray", False):
        from ragsnap.cli.serve_ray import run_on_ray

        return run_on_ray(args, settings, given_fields(args, type(settings)))
    logging.getLogger("ragsnap").setLevel(logging.INFO)  # the one-line-per-request access log
    with loading_model(settings.model, settings.device):
        # fails here, with one clear line, before binding; in a thread of its own, so this
        # one (the HTTP server's) keeps no OpenMP team beside the scheduler's
        engine = in_a_passing_thread(lambda: load_engine(settings))
    settings = keep_threads_for_the_scheduler(settings)
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
