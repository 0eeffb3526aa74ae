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
import math
import os
import signal
import sys
import time
from typing import Any

APP_NAME = "ragsnap"
MIN_REPLICA_CPUS = 0.1


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
    # SIGTERM (a service manager, `kill`) stops like Ctrl-C: the finally below shuts down
    # the Ray processes this command started, instead of leaving them behind (set after
    # ray.init, whose own handler aborts the process)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        app_args = RayAppArgs(replicas=args.replicas or 2, replica_gpus=args.replica_gpus)
        app_args = app_args.model_copy(
            update={
                "replica_cpus": replica_cpus(
                    ray.cluster_resources().get("CPU", 0.0),
                    app_args.replicas,
                    app_args.ingress_cpus,
                    args.replica_cpus,
                    strict=not address,  # a cluster may grow; a local head will not
                ),
                "settings": dict(given),
            }
        )
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


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def replica_cpus(
    cluster_cpus: float, replicas: int, ingress_cpus: float, asked: float | None, strict: bool
) -> float:
    """CPUs reserved per replica: ``asked``, else the cluster's CPUs left by the ingress,
    shared by the replicas (in 0.05 steps). Ray would wait for ever for CPUs the cluster
    does not have, so with ``strict`` a request beyond them is a clear error now."""
    from ragsnap.errors import ConfigError

    if asked is None:
        share = math.floor((cluster_cpus - ingress_cpus) / replicas * 20) / 20
        if share < MIN_REPLICA_CPUS:
            raise ConfigError(
                f"--replicas {replicas}: this Ray cluster has {cluster_cpus:g} CPUs, "
                f"{share:g} a replica after the ingress's {ingress_cpus:g}; use fewer "
                f"replicas or set --replica-cpus",
                field="replicas",
            )
        return share
    needed = replicas * asked + ingress_cpus
    if strict and needed > cluster_cpus + 1e-9:
        raise ConfigError(
            f"--replicas {replicas} x --replica-cpus {asked:g} + the ingress's "
            f"{ingress_cpus:g} = {needed:g} CPUs, but this machine has {cluster_cpus:g}: "
            "lower --replica-cpus (fractions such as 0.5 work) or --replicas",
            field="replica_cpus",
        )
    return asked


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
