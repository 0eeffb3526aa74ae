"""What the CLI tells the user while it works: model loading, and the threads torch uses."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from ragsnap.runtime.threads import configure_threads, default_threads

__all__ = ["configure_threads", "default_threads", "loading_model"]


@contextmanager
def loading_model(model: str | None, device: str | None = "auto") -> Iterator[None]:
    """``ragsnap: loading model ...`` on stderr before, ``... ready in N s`` after: a model
    takes tens of seconds to load on a CPU, and nothing else would show in the meantime."""
    started = time.perf_counter()
    threads = os.environ.get("OMP_NUM_THREADS", "?")
    print(
        f"ragsnap: loading model {model or 'embedded'} (device {device or 'auto'}, "
        f"{threads} thread(s)) ...",
        file=sys.stderr,
        flush=True,
    )
    yield
    print(
        f"ragsnap: model ready in {time.perf_counter() - started:.1f} s",
        file=sys.stderr,
        flush=True,
    )
