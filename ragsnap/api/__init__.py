"""ragsnap's HTTP service: streaming answers, an OpenAI-compatible endpoint, health, metrics.

Build the app with :func:`ragsnap.api.app.create_app`; ``ragsnap serve`` runs it under uvicorn.
"""

from __future__ import annotations

__all__ = ["create_app"]


def __getattr__(name: str) -> object:
    # imported lazily so `import ragsnap.api` does no work (FastAPI is an optional dependency)
    if name == "create_app":
        from ragsnap.api.app import create_app

        return create_app
    raise AttributeError(name)
