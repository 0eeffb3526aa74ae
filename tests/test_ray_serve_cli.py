"""``ragsnap serve --ray``: a local Ray head in the command's process, stopped with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

pytest.importorskip("ray.serve")

from tests.api_helpers import DOCS, FAST  # noqa: E402
from tests.ray_cluster import RAY_ENV, free_port, wait_ready  # noqa: E402
from tests.tiny_models import save_tiny_model  # noqa: E402


def test_serve_ray_starts_a_local_head_and_stops_it(tmp_path):
    model = save_tiny_model(tmp_path / "tiny")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_ENV)
    command = [sys.executable, "-m", "ragsnap", "serve", "--ray", "--replicas", "1"]
    command += ["--replica-cpus", "0.5", "--model", model, "--device", "cpu"]
    command += ["--cache", "none", "--port", str(port)]
    # Ctrl-C as from a terminal, whatever this test process was handed (a parent that
    # ignores SIGINT passes that on to its children)
    server = subprocess.Popen(
        command,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(server.stderr), daemon=True)
    reader.start()
    banner = "replica(s) on a local Ray head"
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, {})
        body = {"question": "t5?", "documents": DOCS, "max_new_tokens": 2, "compression": FAST}
        reply = httpx.post(f"{url}/v1/answer", json=body, timeout=60)
        assert reply.status_code == 200 and reply.json()["stats"]["replica"]
        # the proxy can answer before `serve.run` returns: stop only once the command says so
        deadline = time.monotonic() + 60
        while not any(banner in line for line in lines):
            assert time.monotonic() < deadline, "no start-up line"
            time.sleep(0.1)
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            reader.join(10)
            pytest.fail(
                f"no exit 60 s after SIGINT (SIGINT here: {signal.getsignal(signal.SIGINT)}); "
                + "".join(lines)[-3000:]
            )
        finally:
            server.kill()
    reader.join(10)
    err = "".join(lines)
    assert server.returncode == 0, err[-2000:]
    deadline = time.monotonic() + 10
    while True:  # the port is free again: Serve's proxy went with the head
        try:
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
        except httpx.HTTPError:
            break
        assert time.monotonic() < deadline, "Serve still answers after the command ended"
        time.sleep(0.5)


def test_serve_ray_on_a_busy_port_is_a_clear_error_before_ray_starts():
    import socket

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_ENV)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = [sys.executable, "-m", "ragsnap", "serve", "--ray", "--host", "127.0.0.1"]
        command += ["--port", str(port), "--cache", "none"]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"--port {port}: cannot listen" in done.stderr and "Traceback" not in done.stderr
    assert "Started a local Ray instance" not in done.stderr
