"""Where a run's numbers came from: versions, the source checkout, the machine, the command.

Written into ``settings.json`` under ``provenance`` beside the settings the predictions
depend on; provenance itself is not compared when a run resumes (a new commit may finish
an old run).
"""

from __future__ import annotations

import platform
import subprocess
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any


def package_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def source_checkout(package_dir: Path | None = None) -> dict[str, Any] | None:
    """``{"commit": short sha, "dirty": bool}`` when the package runs from a git checkout
    (its parent folder is the work tree's top), else None (an installed wheel)."""
    package_dir = package_dir or Path(__file__).resolve().parents[1]
    root = package_dir.parent
    top = _git(root, "rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != root.resolve():
        return None
    commit = _git(root, "rev-parse", "--short", "HEAD")
    if commit is None:
        return None
    status = _git(root, "status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": bool(status)}


def provenance(
    runtime: Any,
    grid_configs: Sequence[dict[str, Any]],
    argv: Sequence[str] | None = None,
    layer_profile: str | None = None,
) -> dict[str, Any]:
    """Versions, checkout, model, threads, device, the press grid (every option of every
    press), the layer-profile digest (of ``layer_profile``, default ``auto``: the packaged
    profiles) and the command line."""
    import torch

    from ragsnap.compression.layer_budgets import profile_digest

    loaded = getattr(runtime, "loaded", None)
    return {
        "ragsnap": _version(),
        "checkout": source_checkout(),
        "torch": torch.__version__,
        "transformers": package_version("transformers"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "model": getattr(loaded, "model_id", None),
        "model_revision": getattr(loaded, "revision", None),
        "device": str(getattr(runtime, "device", "")),
        "dtype": str(getattr(getattr(loaded, "model", None), "dtype", "")) or None,
        "matmul_precision": getattr(loaded, "matmul_precision", None),
        "four_bit_weights": getattr(loaded, "four_bit", None),
        "threads": torch.get_num_threads(),
        "grid": list(grid_configs),
        "layer_profile": layer_profile or "auto",
        "layer_profile_digest": profile_digest(layer_profile or "auto"),
        "command": list(sys.argv if argv is None else argv),
    }


def _version() -> str:
    """The installed distribution's version (the source tree's when not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ragsnap")
    except PackageNotFoundError:
        return "unknown"
