"""The environment a local Ray head starts with: direct ingress, and workers at full priority.

**Direct ingress.** By default every request crosses two Ray hops: Serve's HTTP proxy hands the request to
the ingress replica, and each piece of the response travels back to the proxy as a Ray
message. With direct ingress (``RAY_SERVE_ENABLE_DIRECT_INGRESS=1``, Ray >= 2.5x) the
ingress replica runs the uvicorn server of the FastAPI app on a port of its own, so only
the ingress -> engine hop remains (about 15 ms less per request measured here; see
``ragsnap bench overhead``). Serve's proxy still runs on the head node and answers too.

Ray reads these variables when its processes start, so they must be in the environment of
the process that starts the head (``ray.init`` of a local head, or ``ray start --head``),
not set later. :func:`direct_ingress_env` pins the ingress port to the one asked for: one
ingress replica per node (the application has one).

**Worker priority.** Ray starts its worker processes (the replicas among them) at nice 15,
so on a machine shared with other work an engine replica decodes slower than the same
engine in a plain process: measured here under a load average of 4-5, 13-16% slower at
nice 15 and 3-8% at nice 0 (``RAY_worker_niceness=0``, :data:`FULL_PRIORITY`).

**A slow start.** Serve gives its HTTP proxy 5 s to come up, then kills it, and
``serve.start`` fails with ``ActorDiedError`` although a second proxy would have made it:
on a 2-core machine under load its worker process does not start in 5 s. A local head
gives it a minute (:data:`SLOW_START`).

**Quiet control loops.** Serve's controller checks every deployment 10 times a second, and
the replicas and handles export their metrics every 100 ms: 15% of a core with nothing to
do on a one-replica application (CPU seconds of Ray's processes over 20 idle seconds:
2.96). :data:`QUIET` checks twice a second and exports once a second (2.05; lab/results.md,
"Ray Serve's added latency"); a dead replica is still noticed within a second.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

ENABLE = "RAY_SERVE_ENABLE_DIRECT_INGRESS"
FULL_PRIORITY = {"RAY_worker_niceness": "0"}
SLOW_START = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60"}
QUIET = {
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
}


def local_head_env(direct_port: int | None) -> dict[str, str]:
    """What ``ragsnap serve --ray``, ``ragsnap bench overhead`` and the tests start a local
    head with: :data:`FULL_PRIORITY`, :data:`SLOW_START`, :data:`QUIET`, and direct ingress
    on ``direct_port`` unless it is None."""
    direct = direct_ingress_env(direct_port) if direct_port else {}
    return {**FULL_PRIORITY, **SLOW_START, **QUIET, **direct}


def direct_ingress_env(port: int, draining_s: float = 2.0) -> dict[str, str]:
    """The environment of a Ray head whose ingress replica listens on ``port``.

    ``draining_s``: how long a stopping ingress replica keeps accepting (Ray's default, 30 s,
    waits for an external load balancer to notice; a local head has none). Port quarantine
    (held ports between replicas, for HAProxy) is off, so a restarted ingress gets the same
    port at once.
    """
    return {
        ENABLE: "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1),  # the range ends before it
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": str(draining_s),
        "RAY_SERVE_PORT_QUARANTINE_S": "0",
    }


@contextmanager
def environment(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` in ``os.environ`` for the block (a local Ray head started inside inherits
    them); the previous values come back after."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
