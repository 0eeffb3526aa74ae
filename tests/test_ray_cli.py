"""``ragsnap serve --ray --replicas 2`` as a user runs it (issue 41): replicas sized to the
machine without other flags, ready on two cores, and nothing left running after SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("ray.serve")
psutil = pytest.importorskip("psutil")

from ragsnap.cli.serve_ray import replica_cpus  # noqa: E402
from ragsnap.errors import ConfigError  # noqa: E402
from tests.ray_cluster import RAY_ENV, free_port, wait_ready  # noqa: E402
from tests.tiny_models import save_tiny_model  # noqa: E402


def test_replica_cpus_share_the_machine_or_fail_naming_the_flag():
    assert replica_cpus(2.0, 2, 0.25, None, strict=True) == 0.85
    assert replica_cpus(16.0, 3, 0.25, None, strict=True) == 5.25
    assert replica_cpus(2.0, 2, 0.25, 0.5, strict=True) == 0.5
    with pytest.raises(ConfigError, match="--replica-cpus 1 .* 2.25 CPUs, but this machine has 2"):
        replica_cpus(2.0, 2, 0.25, 1.0, strict=True)
    assert replica_cpus(2.0, 2, 0.25, 1.0, strict=False) == 1.0  # a cluster may grow
    with pytest.raises(ConfigError, match="--replicas 40"):
        replica_cpus(2.0, 40, 0.25, None, strict=True)


def test_serve_ray_is_ready_with_no_other_flag_and_sigterm_leaves_no_process(tmp_path):
    model = save_tiny_model(tmp_path / "model")
    port = free_port()
    env = {
        **os.environ,
        **RAY_ENV,
        "RAGSNAP_CACHE_URL": f"file://{tmp_path / 'kv'}",
        "RAGSNAP_DEVICE": "cpu",
    }
    env.pop("RAY_ADDRESS", None)
    command = [sys.executable, "-m", "ragsnap", "serve", "--ray", "--replicas", "2"]
    server = subprocess.Popen(
        [*command, "--model", model, "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "serve.log", "w"),  # noqa: SIM115
        start_new_session=True,
    )
    started: list = []
    try:
        wait_ready(f"http://127.0.0.1:{port}", {}, timeout=300)
        started = psutil.Process(server.pid).children(recursive=True)
        assert started, "no Ray process was started"
        server.send_signal(signal.SIGTERM)
        assert server.wait(120) == 0, (tmp_path / "serve.log").read_text()[-3000:]
        deadline = time.monotonic() + 30
        while alive := [p for p in started if _alive(p)]:
            assert time.monotonic() < deadline, [p.name() for p in alive]
            time.sleep(0.5)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
        for process in started:
            if _alive(process):
                process.kill()


def _alive(process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
