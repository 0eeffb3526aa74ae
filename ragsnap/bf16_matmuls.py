"""``medium`` matmul precision on CPUs that multiply bfloat16 natively.

A float32 model keeps float32 weights (half-precision packed, :mod:`ragsnap.cpu_linears`),
activations, norms, KV cache and softmax. At ``medium`` precision (torch's name for
products with bfloat16 inputs and float32 accumulation, as ``set_float32_matmul_precision``
uses it) two kinds of product round their inputs to bfloat16:

- linear layers over many rows (prefill chunks, batched tails): oneDNN-packed bfloat16
  weights, :class:`~ragsnap.cpu_linears.HalfWeightLinear` with ``many_rows_bf16`` (their
  outputs are rounded to bfloat16 too, as a bfloat16 model's are; the LM head is exempt);
- attention of queries of at least ``LONG_QUERY`` tokens: the CPU sdpa kernel runs its
  query-key and probability-value products through oneDNN in bfloat16
  (``torch.backends.mkldnn.matmul.fp32_precision = "bf16"``) while :func:`bf16_matmuls` is
  active.

Measured on a 2-core AMD EPYC with AVX512-BF16 (no AMX), embedded model, 2 threads: a
2048-token causal attention layer 33 -> 20 ms, a 1024-row linear 3.9 -> 2.0 ms; short
queries (decode steps, drafts) stay on the float32 kernels, which are faster for them
(8 rows x 1 query over 2.3K keys: 1.0 ms in float32, 11 ms with bfloat16 products). The
float32 kernels there are MKL's, which runs AVX2 code on this CPU.

``auto`` picks ``medium`` for float32 models on CPUs that report AVX512-BF16 and whose
torch build packs bfloat16 weights, ``highest`` elsewhere (and for every other dtype, whose
products already run in that dtype).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from ragsnap.errors import ModelLoadError

PRECISIONS = ("auto", "highest", "medium")
# from this many query tokens attention runs with bfloat16 products at medium precision
# (2 threads: 256 queries over 2.3K keys 5.8 against 7.6 ms; 128: 4.1 against 4.1)
LONG_QUERY = 256
# attribute of an attention module whose long queries run with bfloat16 products
BF16_MATMULS = "ragsnap_bf16_matmuls"

_lock = threading.Lock()
_active = 0
_saved: str | None = None


def avx512_bf16() -> bool:
    """Whether this CPU reports AVX512-BF16 (Linux; False where /proc/cpuinfo is unreadable)."""
    try:
        return " avx512_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def resolve_matmul_precision(precision: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a model on ``device`` in ``dtype`` runs at ``medium`` precision.

    ``precision``: ``auto``, ``highest`` or ``medium``. ``medium`` applies to float32 CPU
    models only (elsewhere the products already run in the model's dtype, or on CUDA in
    its own kernels) and needs a torch build and CPU that pack bfloat16 weights.

    Raises ModelLoadError for an unknown value, or ``medium`` where it cannot run.
    """
    from ragsnap.cpu_linears import can_pack, can_pack_half

    if precision not in PRECISIONS:
        raise ModelLoadError(
            f"unknown matmul precision {precision!r} (choose {', '.join(PRECISIONS)})"
        )
    applies = device.type == "cpu" and dtype == torch.float32
    if precision == "highest" or not applies:
        return False
    runnable = can_pack() and can_pack_half()
    if precision == "medium" and not runnable:
        raise ModelLoadError(
            "matmul precision 'medium' needs oneDNN bfloat16 and fbgemm on this CPU "
            "(use highest or auto)"
        )
    return runnable and (precision == "medium" or avx512_bf16())


def mark_attention(model: torch.nn.Module) -> None:
    """Let every attention layer of ``model`` run long queries with bfloat16 products
    (read by the runtime's attention function, :mod:`ragsnap.runtime.attention`)."""
    from ragsnap.compression.hooks import attention_modules

    for module in attention_modules(model):
        setattr(module, BF16_MATMULS, True)


@contextmanager
def bf16_matmuls() -> Iterator[None]:
    """Let oneDNN run float32 products with bfloat16 inputs while the block runs.

    torch keeps this setting per process, not per thread: the first block to enter saves
    the previous value and the last to leave restores it, so overlapping blocks on several
    threads never leave it changed. A float32 product on another thread meanwhile also
    runs in bfloat16 (only models at ``medium`` precision enter these blocks).
    """
    global _active, _saved
    matmul = torch.backends.mkldnn.matmul
    with _lock:
        if _active == 0:
            _saved = matmul.fp32_precision
            matmul.fp32_precision = "bf16"
        _active += 1
    try:
        yield
    finally:
        with _lock:
            _active -= 1
            if _active == 0:
                matmul.fp32_precision = _saved
