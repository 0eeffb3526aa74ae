"""What the CLI tells the user while it works: model loading, and the threads torch uses."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from ragsnap.errors import ConfigError
from ragsnap.runtime.threads import available_cores


def default_threads(cores: int | None = None) -> int:
    """1 on machines of two cores or fewer, else half the cores: torch's default (every
    core) spin-waits against other processes and made answers 4-6x slower on a busy
    2-core machine than one thread (issue 16)."""
    cores = available_cores() if cores is None else cores
    return 1 if cores <= 2 else cores // 2


def configure_threads(threads: int | None) -> int:
    """Use ``threads`` torch intra-op threads (None: ``$OMP_NUM_THREADS`` if set, else
    :func:`default_threads`); returns the number chosen."""
    if threads is None:
        env = os.environ.get("OMP_NUM_THREADS", "")
        threads = int(env) if env.isdigit() and int(env) > 0 else default_threads()
    if threads < 1:
        raise ConfigError(f"--threads must be at least 1, got {threads}", field="threads")
    # read by torch when it is imported; set_num_threads covers an already imported torch
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ["MKL_NUM_THREADS"] = str(threads)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)
    return threads


@contextmanager
def loading_model(model: str, device: str = "auto") -> Iterator[None]:
    """``ragsnap: loading model ...`` on stderr before, ``... ready in N s`` after: a model
    takes tens of seconds to load on a CPU, and nothing else would show in the meantime."""
    started = time.perf_counter()
    threads = os.environ.get("OMP_NUM_THREADS", "?")
    print(
        f"ragsnap: loading model {model} (device {device}, {threads} thread(s)) ...",
        file=sys.stderr,
        flush=True,
    )
    yield
    print(
        f"ragsnap: model ready in {time.perf_counter() - started:.1f} s",
        file=sys.stderr,
        flush=True,
    )
