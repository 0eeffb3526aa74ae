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
from collections.abc import Iterator
from contextlib import contextmanager


def available_cores() -> int:
    """Cores this process may run on (its affinity, where the OS says)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - macOS, Windows
        return os.cpu_count() or 1


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
