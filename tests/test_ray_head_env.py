"""The environment of a local Ray head: the variables are ones Ray reads, with our values."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("ray.serve")

from ragsnap.api.ray_head_env import environment, local_head_env  # noqa: E402

READ_BACK = """
import json
from ray.serve._private import constants as c
print(json.dumps({
    "proxy_ready_s": c.PROXY_READY_CHECK_TIMEOUT_S,
    "control_loop_s": c.CONTROL_LOOP_INTERVAL_S,
    "metrics_export_ms": c.RAY_SERVE_METRICS_EXPORT_INTERVAL_MS,
    "direct_ingress": c.RAY_SERVE_ENABLE_DIRECT_INGRESS,
    "direct_min_port": c.RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT,
}))
"""


def _serve_constants(env: dict[str, str]) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", READ_BACK], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_serve_reads_the_local_head_environment():
    plain = {k: v for k, v in os.environ.items() if not k.startswith("RAY_SERVE_")}
    default = _serve_constants(plain)
    ours = _serve_constants({**plain, **local_head_env(18123)})
    assert ours == {
        "proxy_ready_s": 60.0,
        "control_loop_s": 0.5,
        "metrics_export_ms": 1000,
        "direct_ingress": True,
        "direct_min_port": 18123,
    }
    # each is a change from Ray's own default, so a renamed variable would show here
    assert all(default[key] != value for key, value in ours.items())


def test_without_a_port_there_is_no_direct_ingress():
    env = local_head_env(None)
    assert "RAY_SERVE_ENABLE_DIRECT_INGRESS" not in env
    assert env["RAY_worker_niceness"] == "0"


def test_environment_restores_what_was_there(monkeypatch):
    monkeypatch.setenv("RAY_worker_niceness", "15")
    monkeypatch.delenv("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", raising=False)
    with environment(local_head_env(None)):
        assert os.environ["RAY_worker_niceness"] == "0"
        assert os.environ["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.5"
    assert os.environ["RAY_worker_niceness"] == "15"
    assert "RAY_SERVE_CONTROL_LOOP_INTERVAL_S" not in os.environ
