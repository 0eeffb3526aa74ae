"""int8 storage of cached keys and values: symmetric, one scale per head and token.

A stored KV entry is memory in the store and bytes on every hit; keys and values in int8
take a quarter of float32 (half of bfloat16), plus one float32 scale per ``D`` values.
Each head's vector at each position is scaled by its own largest magnitude, so an outlier
token (attention sinks carry large values) costs no precision to the others.
"""

from __future__ import annotations

import torch

INT8_MAX = 127


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[..., D]`` (float) -> ``(q, scale)``: ``q`` int8 ``[..., D]`` and ``scale``
    float32 ``[..., 1]`` with ``x ~= q * scale`` (error at most ``scale / 2`` per value)."""
    x = x.detach().float()
    scale = x.abs().amax(dim=-1, keepdim=True) / INT8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero vector
    q = torch.round(x / scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """``q`` int8 ``[..., D]`` times ``scale`` ``[..., 1]``, as ``dtype`` on ``device``."""
    return (q.to(device, torch.float32) * scale.to(device, torch.float32)).to(dtype)
