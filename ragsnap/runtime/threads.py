"""Torch intra-op threads per phase of serving.

Prefill is compute-bound (a 2K-token prompt in 124-token chunks: 1.6x faster on two threads
than on one, on a 2-core AVX2 CPU); a decode step of 4-8 rows is too (8 rows: 52 against
74 ms on two threads and one). Both run on the scheduler's thread, which must be the only
thread computing on several: every such thread keeps an OpenMP team, and once the teams'
threads outnumber the cores libgomp stops spinning between parallel regions, so the
hundreds of short regions of a decode step ran no faster on two threads than on one. The
scheduler's helper threads and the HTTP server's compute on one. Nothing here imports
torch before it is used: the CLI sets its thread environment first.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from ragsnap.errors import ConfigError

T = TypeVar("T")


def available_cores() -> int:
    """Cores this process may run on (its affinity, where the OS says)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - macOS, Windows
        return os.cpu_count() or 1


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
def torch_threads(count: int | None) -> Iterator[None]:
    """Run the block on ``count`` torch intra-op threads (None: as they are), then restore."""
    import torch

    before = torch.get_num_threads()
    if count is None or count == before:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def one_torch_thread() -> None:
    """Compute on one torch thread in the calling thread: the initializer of helper threads
    (see the module docstring)."""
    import torch

    torch.set_num_threads(1)


# nice value of threads whose work may wait for idle cores (the store writer)
BACKGROUND_NICE = 19


def background_torch_thread() -> None:
    """The initializer of a thread whose work may wait (the store's writes): one torch
    thread at the lowest CPU priority (Linux: nice 19, this thread only), so it computes
    on cores the scheduler leaves idle. On 2 cores, 8 cold misses' entry writes (0.5 s
    each) beside the scheduler's two threads made its decode steps take 94 instead of
    44 ms."""
    one_torch_thread()
    if sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
        except OSError:  # not permitted here: the writes share the cores as before
            pass


def in_a_passing_thread(work: Callable[[], T]) -> T:
    """``work()`` in a thread of its own that ends with it; returns its result (raises its
    exception). The OpenMP team it computes on ends with that thread, so the calling
    thread holds none: a server that loaded its model in its HTTP thread on two threads
    kept that thread's team, and the scheduler's prefill then took 20-40% longer on a
    2-core CPU (3.4K tokens: 1.8 s in the main thread, 2.25 s in another thread beside an
    idle team, 2.7 s in 1024-token chunks; 1.8 s for both once the first team was gone)."""
    result: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result.append(work())
        except BaseException as exc:  # re-raised in the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=run, name="ragsnap-load")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]
