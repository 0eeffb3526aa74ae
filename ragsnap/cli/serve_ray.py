"""``ragsnap serve --ray``: the service as a Ray Serve application.

Without ``RAY_ADDRESS`` a Ray head starts in this process (its ports are chosen free, so
a Redis on 6379 is left alone) and stops with it; its ingress replica serves ``--port``
itself (Ray Serve direct ingress, :mod:`ragsnap.api.ray_head_env`: one Ray hop less per
request and per streamed token) unless ``--ray-proxy`` is given, and Serve's own HTTP proxy
listens on a free port beside it. With ``RAY_ADDRESS`` the application is deployed on that
cluster (behind its proxy on ``--port``, or on the cluster's direct-ingress ports when the
cluster was started with them) and deleted from it on Ctrl-C (``serve deploy
deploy/serve.yaml`` leaves one running instead).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

APP_NAME = "ragsnap"


def run_on_ray(args: argparse.Namespace, settings: Any, given: dict[str, Any]) -> int:
    """Start (or join) Ray, run the application on ``settings.host:port``, block until Ctrl-C."""
    try:
        import ray
        from ray import serve

        from ragsnap.api.ray_app import RayAppArgs, build_app
        from ragsnap.api.ray_head_env import environment, local_head_env
    except ImportError as exc:
        from ragsnap.errors import ConfigError

        raise ConfigError(
            f"--ray needs the 'ray' extra: pip install 'ragsnap[ray]' ({exc.name})"
        ) from None

    app_args = RayAppArgs(
        replicas=args.replicas or 2,
        replica_cpus=args.replica_cpus or 1.0,
        replica_gpus=args.replica_gpus,
        settings=dict(given),
    )
    address = os.environ.get("RAY_ADDRESS")
    direct = not address and not getattr(args, "ray_proxy", False)
    if not address:
        _check_port_free(settings.host, settings.port)
    proxy_port = _free_port(settings.host) if direct else settings.port
    if address:
        ray.init(address=address)
    else:  # read by the head's processes as they start
        with environment(local_head_env(settings.port if direct else None)):
            ray.init(include_dashboard=False)
    try:
        serve.start(http_options={"host": settings.host, "port": proxy_port})
        serve.run(build_app(app_args), name=APP_NAME, route_prefix="/")
        where = f"the Ray cluster at {address}" if address else "a local Ray head"
        how = f" (direct ingress; Serve's proxy on port {proxy_port})" if direct else ""
        print(
            f"ragsnap: serving {settings.model} with {app_args.replicas} replica(s) on {where} "
            f"at http://{settings.host}:{settings.port}{how}; stop with Ctrl-C",
            file=sys.stderr,
            flush=True,
        )
        while True:
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        try:
            serve.delete(APP_NAME)
            if not address:
                serve.shutdown()
        finally:
            ray.shutdown()
    return 0


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _check_port_free(host: str, port: int) -> None:
    """A clear error now, rather than a deployment failing after Ray started."""
    import socket

    from ragsnap.errors import ConfigError

    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise ConfigError(
                f"--port {port}: cannot listen on {host}:{port} ({exc.strerror})", field="port"
            ) from None
