"""``bash scripts/gpu_check.sh`` on a machine without CUDA: one line saying so, exit 0, at
once (on a CUDA machine it installs, tests and benchmarks: tests/test_cuda.py)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HAS_NVIDIA = Path("/dev/nvidia0").exists() or shutil.which("nvidia-smi") is not None


@pytest.mark.skipif(HAS_NVIDIA, reason="an NVIDIA device is here: the check would run in full")
def test_without_cuda_the_gpu_check_says_so_in_one_line_and_succeeds() -> None:
    done = subprocess.run(
        ["bash", "scripts/gpu_check.sh"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("\n") == 1 and "no CUDA device" in done.stdout
    assert done.stderr == ""


def test_the_gpu_check_installs_the_gpu_extra_and_runs_the_cuda_tests() -> None:
    import tomllib

    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert any(
        r.startswith("flash-attn") for r in project["project"]["optional-dependencies"]["gpu"]
    )
    assert any(m.startswith("cuda:") for m in project["tool"]["pytest"]["ini_options"]["markers"])
    assert '["optional-dependencies"]["gpu"]' in script and "-m cuda tests/test_cuda.py" in script
