"""CPU weight layouts that make few-row GEMMs (the batched decode step) fast.

On CPU, a decode step multiplies a handful of rows by every weight matrix of the model, so
its time is the time to stream the weights through the GEMM kernel. The default layouts do
that badly for small row counts:

- float32: ``x @ W.T`` with a row-major ``W`` ``[out, in]`` costs 3x one row at 8 rows on the
  embedded model's shapes; stored column-major, 1.3x (no worse for long prefill chunks).
- bfloat16: ``torch.nn.functional.linear`` streams about half the bytes per second oneDNN
  reaches with a weight reordered ahead of time into its own blocked layout
  (``mkldnn._reorder_linear_weight``): one decode step's GEMMs take 0.65x the time at 1 to 8
  rows and no longer at 1024-row prefill chunks (``ragsnap bench batch --compare-linears``
  measures it).
- float32 with fbgemm (any x86 CPU with AVX2): a weight stored in half precision and
  packed by fbgemm, computed in float32 (``quantized::linear_dynamic_fp16``), streams half
  the bytes: one 8-row decode step of the embedded model takes about 0.6x the time
  (149 -> 95 ms, one thread), and 1024-token prefill chunks no longer. Rounding the weights
  to half precision moves the embedded model's logits by at most about 0.03 (its weights
  came from 4-bit blocks with half-precision scales) and left greedy answers unchanged in
  our checks; ``ragsnap bench batch --compare-linears`` times packed against dense.
- float32 at ``medium`` matmul precision (:mod:`ragsnap.runtime.loading.bf16_matmuls`): the same layer also
  keeps a oneDNN-packed bfloat16 copy of its weight for the documents' passes: their
  activations are rounded to bfloat16 on the way in, the product accumulates in float32
  and is rounded to bfloat16 on the way out (as in a bfloat16 model's layer), then
  widened back to float32. On a CPU with AVX512-BF16 a 1024-row product takes 0.5x the
  time of the half-precision one (40 rows 0.7x, 8 rows the same).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from ragsnap.runtime.loading.bf16_matmuls import medium_allowed
from ragsnap.runtime.loading.four_bit_linears import FourBitLinear

logger = logging.getLogger(__name__)


def column_major_linears(model: torch.nn.Module) -> None:
    """Store every linear weight (``[out, in]``) column-major, in place; values unchanged.

    Tied weights (an LM head sharing the embedding) change layout once, for both.
    """
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.weight.is_contiguous():
                module.weight.data = module.weight.data.t().contiguous().t()


class PackedLinear(torch.nn.Module):
    """A bfloat16 linear layer whose weight is held in oneDNN's reordered layout, for
    inference only.

    ``forward``: ``x`` ``[..., in_features]`` (the weight's dtype) -> ``[..., out_features]``.
    The packed weight is an opaque ``_mkldnn`` tensor kept as a plain attribute, so it is
    outside ``state_dict`` and ``.to()``; the dense weight is not kept (an LM head tied to the
    embedding leaves the embedding's dense copy where it was).
    """

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        with torch.no_grad():
            # the batch-size hint only tunes the reorder: any row count works afterwards
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def dense_weight(self) -> torch.Tensor:
        """The weight ``[out, in]`` as a dense tensor (the values the layer computes with)."""
        return self.packed.to_dense()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN-packed"


class HalfWeightLinear(torch.nn.Module):
    """A float32 linear layer whose weight is stored in half precision, packed by fbgemm.

    ``forward``: ``x`` ``[..., in_features]`` float32 -> ``[..., out_features]`` float32;
    the GEMM widens the weight to float32 as it streams it, so only the weight is rounded
    (the activations are not quantized, so rows computed together do not affect each other
    beyond float32 rounding). The packed weight (and
    the bias, packed with it) is an opaque fbgemm object, outside ``state_dict``.

    ``documents_bf16``: also keep the weight oneDNN-packed in bfloat16 and multiply with it
    inside :func:`~ragsnap.runtime.loading.bf16_matmuls.medium_products` (the documents' passes):
    activations and product rounded to bfloat16, float32 accumulation, float32 result
    (``medium`` matmul precision; needs :func:`can_pack`).
    """

    def __init__(self, linear: torch.nn.Linear, documents_bf16: bool = False) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        with torch.no_grad():
            weight = linear.weight.detach().float().contiguous()
            bias = None if linear.bias is None else linear.bias.detach().float()
            self.packed = torch.ops.quantized.linear_prepack_fp16(weight, bias)
            self.packed_bf16 = (
                torch.ops.mkldnn._reorder_linear_weight(weight.to(torch.bfloat16), 1)
                if documents_bf16
                else None
            )
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_bf16 is not None and medium_allowed():
            out = torch.ops.mkldnn._linear_pointwise(
                x.to(torch.bfloat16), self.packed_bf16, None, "none", [], ""
            ).float()
            return out if self.bias is None else out.add_(self.bias)
        return torch.ops.quantized.linear_dynamic_fp16(x, self.packed)

    def dense_weight(self) -> torch.Tensor:
        """The weight ``[out, in]`` in float32, as rounded to half precision."""
        return torch.ops.quantized.linear_unpack_fp16(self.packed)[0]

    def extra_repr(self) -> str:
        documents = ", bfloat16 for documents" if self.packed_bf16 is not None else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"fbgemm half-precision weight{documents}"
        )


@functools.cache
def can_pack() -> bool:
    """Whether bfloat16 linears can be packed here: the torch build has oneDNN's reordered
    linear and this CPU runs its bfloat16 path (oneDNN wants AVX-512 BW/VL/DQ or
    AVX-NE-CONVERT; an AVX2-only CPU refuses the reorder). Probed once, on a tiny weight."""
    ops = torch.ops.mkldnn
    if not (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    ):
        return False
    try:
        with torch.no_grad():
            ops._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 1)
    except RuntimeError as exc:
        logger.info("bfloat16 linears stay dense on this CPU: %s", exc)
        return False
    return True


@functools.cache
def can_pack_half() -> bool:
    """Whether float32 linears can keep fbgemm-packed half-precision weights here (the torch
    build has fbgemm, which needs AVX2). Probed once, on a tiny weight."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return False
    try:
        with torch.no_grad():
            packed = torch.ops.quantized.linear_prepack_fp16(torch.zeros(16, 16), None)
            torch.ops.quantized.linear_dynamic_fp16(torch.zeros(1, 16), packed)
    except (RuntimeError, AttributeError) as exc:
        logger.info("float32 linears stay dense on this CPU: %s", exc)
        return False
    return True


def pack_linears(model: torch.nn.Module, documents_bf16: bool = False) -> int:
    """Replace the ``nn.Linear`` layers of a CPU ``model`` by packed ones, in place: bfloat16
    weights by :class:`PackedLinear`, float32 ones by :class:`HalfWeightLinear`
    (``documents_bf16``: with a bfloat16 copy for the documents' passes, except the LM
    head, whose logits stay as exact as without it; ignored where :func:`can_pack` is false).

    Returns how many were replaced (0 when this build or CPU cannot pack the model's dtype;
    a layer whose packing fails is left as it was).
    """
    packers: dict[torch.dtype, Callable[[torch.nn.Linear], torch.nn.Module]] = {}
    if can_pack():
        packers[torch.bfloat16] = PackedLinear
    if can_pack_half():
        packers[torch.float32] = functools.partial(
            HalfWeightLinear, documents_bf16=documents_bf16 and can_pack()
        )
    head = getattr(model, "get_output_embeddings", lambda: None)()
    targets = [
        (
            parent,
            name,
            child,
            HalfWeightLinear
            if child is head and child.weight.dtype == torch.float32
            else packers[child.weight.dtype],
        )
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is torch.nn.Linear and child.weight.dtype in packers
    ]
    packed = 0
    for parent, name, child, packer in targets:
        try:
            setattr(parent, name, packer(child))
        except RuntimeError as exc:  # an unsupported shape on this build: keep it dense
            logger.info("kept %s dense: %s", name, exc)
            continue
        packed += 1
    return packed


def unpack_linears(model: torch.nn.Module) -> int:
    """Turn every packed linear of ``model`` back into a dense ``nn.Linear``, in place (the
    values it computed with; a 4-bit copy for few rows is dropped too); returns how many.
    Benchmarks compare the layouts with it."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, FourBitLinear):
                setattr(parent, name, child.inner)
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, (PackedLinear, HalfWeightLinear))
    ]
    for parent, name, child in targets:
        dense = torch.nn.Linear(
            child.in_features, child.out_features, bias=child.bias is not None, device="meta"
        )
        weight = child.dense_weight()
        if isinstance(child, HalfWeightLinear):  # the layout float32 models load with
            weight = weight.t().contiguous().t()
        dense.weight = torch.nn.Parameter(weight, requires_grad=False)
        dense.bias = child.bias
        setattr(parent, name, dense)
    return len(targets)
