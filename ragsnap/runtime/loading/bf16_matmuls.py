"""``medium`` matmul precision: the documents' pass of a float32 CPU model in bfloat16 products.

A float32 model keeps float32 weights (half-precision packed, :mod:`ragsnap.runtime.loading.cpu_linears`),
activations, norms, KV cache and softmax. At ``medium`` precision (torch's name for
products with bfloat16 inputs and float32 accumulation, as ``set_float32_matmul_precision``
uses it), the pass over a prompt's documents
(:func:`~ragsnap.runtime.prefill.prefill_full` inside :func:`medium_products`: the prefix
tier's pass, which a whole prompt also runs first, see
:meth:`~ragsnap.runtime.model_runtime.ModelRuntime.prefill_prompt`) runs its products in
bfloat16:

- linear layers: oneDNN-packed bfloat16 weights
  (:class:`~ragsnap.runtime.loading.cpu_linears.HalfWeightLinear` with ``documents_bf16``; activations
  and outputs rounded to bfloat16, as a bfloat16 model's are; the LM head is exempt);
- attention: the CPU sdpa kernel runs its query-key and probability-value products
  through oneDNN in bfloat16 (``torch.backends.mkldnn.matmul.fp32_precision = "bf16"``
  while :func:`bf16_matmuls` is active).

The question tail, the drafts and the answer's decode steps stay float32, and so does
every pass of a prefix hit: a prompt's answer is the same whether its documents' KV was
computed now or loaded from the cache (both come from a medium pass over the documents and
an exact one over the rest).

Measured on a 2-core AMD EPYC with AVX512-BF16 (no AMX), embedded model, 2 threads: a
2048-token causal attention layer 33 -> 20 ms, a 1024-row linear 3.9 -> 2.0 ms (MKL's
float32 kernels run AVX2 code on this CPU; oneDNN's bfloat16 ones AVX512-BF16). Short
products are not faster this way (8 rows x 1 query over 2.3K keys: 1.0 ms in float32, 11
ms with bfloat16 products), which is one more reason the decode steps stay float32.

:func:`ragsnap.runtime.loading.models.resolve_matmul_precision` decides: ``auto`` picks ``medium`` for
float32 models on CPUs that report AVX512-BF16 and whose torch build packs bfloat16
weights, ``highest`` elsewhere (and for every other dtype, whose products already run in
that dtype).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

# attribute of an attention module of a model at medium precision
BF16_MATMULS = "ragsnap_bf16_matmuls"
# whether this thread's passes are over document positions (see medium_products)
_DOCUMENTS: ContextVar[bool] = ContextVar("ragsnap_medium_products", default=False)

_lock = threading.Lock()
_active = 0
_saved: str | None = None


@contextmanager
def medium_products(enabled: bool = True) -> Iterator[None]:
    """The passes in this block (this thread only) are over document positions: a model at
    ``medium`` precision runs their products in bfloat16; others are unaffected."""
    token = _DOCUMENTS.set(enabled)
    try:
        yield
    finally:
        _DOCUMENTS.reset(token)


def medium_allowed() -> bool:
    """Whether this thread is inside :func:`medium_products`."""
    return _DOCUMENTS.get()


def mark_attention(model: torch.nn.Module) -> None:
    """Let every attention layer of ``model`` run document passes with bfloat16 products
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
    matmul = torch.backends.mkldnn.matmul  # type: ignore[attr-defined]
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
