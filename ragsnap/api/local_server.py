"""An app served by uvicorn in a background thread (benchmarks and tests)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def running_server(app: Any, host: str = "127.0.0.1") -> Iterator[str]:
    """Serve ``app`` on a free port of ``host`` until the block ends; yields its base URL."""
    import uvicorn

    from ragsnap.api.http_protocol import server_options

    options = server_options(app.state.settings) if hasattr(app.state, "settings") else {}
    config = uvicorn.Config(app, host=host, port=0, log_level="warning", lifespan="on", **options)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="ragsnap-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(60)
