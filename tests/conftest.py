"""Shared fixtures. The embedded model is loaded once per test session (about 30 s on CPU)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def engine():
    """The real engine on the embedded SmolLM2-135M-Instruct model (CPU)."""
    from ragsnap.engine import RagSnapEngine

    return RagSnapEngine.load("embedded", device="cpu")
