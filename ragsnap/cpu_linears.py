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
"""

from __future__ import annotations

import functools
import logging

import torch

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
    """A linear layer whose weight is held in oneDNN's reordered layout, for inference only.

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

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN-packed"


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


def pack_linears(model: torch.nn.Module) -> int:
    """Replace every ``nn.Linear`` of a CPU bfloat16 ``model`` by a ``PackedLinear``, in place.

    Returns how many were replaced (0 when the build cannot pack, or a reorder fails; the
    model is then left as it was, module by module).
    """
    if not can_pack():
        return 0
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is torch.nn.Linear and child.weight.dtype == torch.bfloat16
    ]
    packed = 0
    for parent, name, child in targets:
        try:
            setattr(parent, name, PackedLinear(child))
        except RuntimeError as exc:  # an unsupported shape on this build: keep it dense
            logger.info("kept %s dense: %s", name, exc)
            continue
        packed += 1
    return packed


def unpack_linears(model: torch.nn.Module) -> int:
    """Turn every ``PackedLinear`` of ``model`` back into a dense ``nn.Linear``, in place
    (same values); returns how many. Benchmarks compare the two layouts with it."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, PackedLinear)
    ]
    for parent, name, child in targets:
        dense = torch.nn.Linear(
            child.in_features, child.out_features, bias=child.bias is not None, device="meta"
        )
        dense.weight = torch.nn.Parameter(child.packed.to_dense(), requires_grad=False)
        dense.bias = child.bias
        setattr(parent, name, dense)
    return len(targets)
