"""A local Ray cluster with the ragsnap Serve application deployed from ``deploy/serve.yaml``.

The head starts with the environment ``ragsnap serve --ray`` gives a local head
(:func:`ragsnap.api.ray_head_env.local_head_env`: direct ingress, the ingress replica's own
HTTP server on ``url``; a minute for the proxy to start); Serve's HTTP proxy answers on
``proxy_url`` too.

One cluster and one application serve every Ray test of a run (starting them costs
about half a minute on two cores); the fixture that starts them shuts them down.
"""

from __future__ import annotations

import os
import random
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

SERVE_CONFIG = Path(__file__).resolve().parent.parent / "deploy" / "serve.yaml"
# Ray reads these at start: no token auth on a throwaway local cluster (CI has no token),
# no usage report, no dashboard process
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def free_port() -> int:
    """A free port below Linux's ephemeral range (32768-60999): one the kernel hands out
    could be taken by one of Ray's own connections before the ingress replica binds it
    (Ray then blocks it, and a one-port range leaves the replica none: NoAvailablePortError)."""
    for port in random.sample(range(20000, 32000), 200):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port between 20000 and 32000")


@dataclass
class RayApp:
    url: str  # the ingress replica's own server (direct ingress)
    proxy_url: str  # Serve's HTTP proxy in front of the same ingress
    name: str
    config: dict[str, Any]
    settings: dict[str, Any]

    def engine_handle(self) -> Any:
        from ray import serve

        return serve.get_deployment_handle("EngineReplica", app_name=self.name)


def wait_ready(url: str, headers: dict[str, str], timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}/readyz", headers=headers, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("the Ray Serve application did not become ready")
        time.sleep(0.5)


@contextmanager
def ray_app(settings: dict[str, Any], headers: dict[str, str], **args: Any) -> Iterator[RayApp]:
    """Start Ray (2 CPUs, fresh ports), deploy the first application of ``deploy/serve.yaml``
    with ``args`` and ``settings`` over its own, yield it; shut everything down after."""
    import ray
    from ray import serve
    from ray._common.utils import import_attr
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    from ragsnap.api.ray_head_env import local_head_env

    direct_port = free_port()
    env = {**RAY_ENV, **local_head_env(direct_port)}
    saved = {k: os.environ.get(k) for k in (*env, "RAY_ADDRESS")}
    os.environ.update(env)
    os.environ.pop("RAY_ADDRESS", None)  # a local cluster of our own, never the user's
    config = yaml.safe_load(SERVE_CONFIG.read_text())
    app = config["applications"][0]
    merged = {**app["args"], **args, "settings": {**app["args"]["settings"], **settings}}
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        # what `serve run deploy/serve.yaml` does with the application's import path and args
        target = call_user_app_builder_with_args_if_necessary(
            import_attr(app["import_path"]), merged
        )
        serve.run(target, name=app["name"], route_prefix=app["route_prefix"])
        url, proxy_url = f"http://127.0.0.1:{direct_port}", f"http://127.0.0.1:{port}"
        wait_ready(url, headers)
        wait_ready(proxy_url, headers)
        yield RayApp(url, proxy_url, app["name"], config, merged["settings"])
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
