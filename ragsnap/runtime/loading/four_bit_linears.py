"""Decode steps on 4-bit weights, where the model's weights are 4-bit blocks already.

A decode step multiplies a few rows by every weight of the model, so its linears cost the
time to stream the weights (bfloat16: 2 bytes a weight). The embedded model ships as a
GGUF of 4-bit blocks (Q4_1: 32 weights share a scale ``d`` and a minimum ``m``, each weight
``d * q + m`` with ``q`` in 0..15) that loading widens to bfloat16: its weights still lie on
that grid, up to bfloat16's rounding. Where every group of 32 of a layer's weights does,
the layer keeps a 4-bit copy (torch's int4 weight-only kernel, ``w = (q - 8) * s + z`` with
``s`` and ``z`` in bfloat16) and products of at most :data:`MAX_ROWS` rows use it: a
quarter of the bytes. Measured on this project's 2-core AMX Xeon, 2 threads, the 121
linears of one step (the embedded model's shapes) against the oneDNN-packed bfloat16 ones:
1 row 5.7 against 20.1 ms, 4 rows 10.1 against 19.7, 8 rows 17.4 against 20.5, while 12
rows already take longer than the dense weights (hence the bound: prefill chunks and
12-token speculative passes keep the dense, packed weight). A decode step of 4 compressed
rows: 38 against 52 ms.

The 4-bit weights differ from the loaded bfloat16 ones by at most :data:`GRID_TOLERANCE` of
a group's step (0.053 measured on the embedded model, whose bfloat16 rounding alone moves a
weight by up to 0.03 of a step): two roundings of the same 4-bit model. The dense weight is
then set to the 4-bit one (rounded to bfloat16), so a prefill and a decode step compute
with the same weights up to bfloat16's rounding. A model whose
weights are not on such a grid (any model not quantized to 4 bits) keeps its layers as
they are.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

GROUP = 32  # weights per scale along the input dimension (GGUF Q4_0/Q4_1 blocks)
MAX_ROWS = 8  # products of at most this many rows use the 4-bit weights
# a weight may sit this far (in steps of its group) from the 4-bit grid it is read on
GRID_TOLERANCE = 0.1


def on_grid(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``weight`` ``[out, in]`` as 4-bit levels: ``(q, scales_zeros)`` with ``q`` int32
    ``[out, in]`` in 0..15 and ``scales_zeros`` ``[in / GROUP, out, 2]`` in ``weight``'s dtype
    (``w ~= (q - 8) * s + z``), or None when a group of :data:`GROUP` weights is not on a
    16-level grid within :data:`GRID_TOLERANCE` of its step (or the shape does not divide
    into the kernel's blocks)."""
    out_features, in_features = weight.shape
    if in_features % GROUP or out_features % 16:  # the kernel's blocks
        return None
    groups = weight.detach().float().view(out_features, in_features // GROUP, GROUP)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    step = (high - low) / 15
    levels = torch.round((groups - low) / torch.where(step > 0, step, 1.0)).clamp_(0, 15)
    zero = low + 8 * step
    scales_zeros = torch.cat([step, zero], -1).permute(1, 0, 2).to(weight.dtype).contiguous()
    levels = levels.view(out_features, in_features).to(torch.int32)
    off = (dequantized(levels, scales_zeros) - weight.float()).abs().view_as(groups)
    if bool((off > GRID_TOLERANCE * step + 1e-30).any()):
        return None
    return levels, scales_zeros


def dequantized(levels: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    """The weights ``[out, in]`` (float32) that 4-bit ``levels`` ``[out, in]`` and their
    ``scales_zeros`` ``[in / GROUP, out, 2]`` stand for, as the kernel reads them."""
    scale, zero = scales_zeros.float().permute(1, 0, 2).unsqueeze(-2).unbind(-1)
    grouped = levels.float().view(levels.shape[0], -1, GROUP)
    return ((grouped - 8) * scale + zero).view(levels.shape)


class FourBitLinear(torch.nn.Module):
    """A dense linear layer ``inner`` whose weights lie on a 4-bit grid: few-row products read
    the 4-bit copy, the others ``inner`` (whose weight is set to the 4-bit one; it may be
    packed afterwards).

    ``forward``: ``x`` ``[..., in_features]`` -> ``[..., out_features]``.
    """

    def __init__(self, inner: torch.nn.Linear, levels: torch.Tensor, scales_zeros: torch.Tensor):
        super().__init__()
        self.inner = inner
        self.in_features, self.out_features = levels.shape[1], levels.shape[0]
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(levels, 2)
        self.scales_zeros = scales_zeros
        self.bias = getattr(inner, "bias", None)
        # the dense weight becomes the 4-bit one as bfloat16 holds it, so many-row and
        # few-row products compute with the same weights (bfloat16 rounding apart)
        with torch.no_grad():
            inner.weight.copy_(dequantized(levels, scales_zeros))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows > MAX_ROWS or x.dtype != self.scales_zeros.dtype:
            return self.inner(x)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.reshape(rows, self.in_features), self.packed, GROUP, self.scales_zeros
        )
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        shape = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"{shape}, 4-bit up to {MAX_ROWS} rows"


def four_bit_linears(model: torch.nn.Module) -> int:
    """Wrap the ``nn.Linear`` layers of ``model``'s decoder layers in :class:`FourBitLinear`,
    in place, when every one of them is bfloat16 on a 4-bit grid (before packing: the
    wrapped layer is packed as any other). Returns how many; 0 when a layer is off the grid
    (not a 4-bit model), for other dtypes, or when this torch has no int4 CPU kernel."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        return 0
    grids = []
    for parent in layers.modules():
        for name, child in parent.named_children():
            if type(child) is not torch.nn.Linear:
                continue
            grid = on_grid(child.weight) if child.weight.dtype == torch.bfloat16 else None
            if grid is None:
                return 0  # one layer off the grid: not a 4-bit model
            grids.append((parent, name, child, grid))
    try:  # whether this build has the int4 CPU kernel, before any weight changes
        torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            torch.zeros(16, GROUP, dtype=torch.int32), 2
        )
    except (RuntimeError, AttributeError) as exc:
        logger.info("4-bit weights unavailable: %s", exc)
        return 0
    for parent, name, child, grid in grids:
        setattr(parent, name, FourBitLinear(child, *grid))
    return len(grids)
