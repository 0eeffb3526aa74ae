"""Decoding with a per-kept-key additive attention bias (from Attention Matching).

A registered transformers attention function, ``ragsnap_<impl>``, wraps the model's own
implementation (sdpa, eager or flash_attention_2). While :func:`attention_bias` is active
for a layer, it runs sdpa with an additive float mask that carries the bias (flash-attn
takes no arbitrary bias); otherwise it calls the original implementation unchanged.
Nothing is patched: the function is registered when an engine asks for it, and the bias
lives in a context variable, so concurrent threads never see each other's bias.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn.functional as F

_ACTIVE_BIAS: ContextVar[Mapping[int, torch.Tensor] | None] = ContextVar(
    "ragsnap_bias", default=None
)
PREFIX = "ragsnap_"


@contextmanager
def attention_bias(bias: Mapping[int, torch.Tensor] | None) -> Iterator[None]:
    """Add ``bias[layer]`` (``[B, Hkv, n]``) to the logits of the first ``n`` cached keys of each layer."""
    token = _ACTIVE_BIAS.set(bias or None)
    try:
        yield
    finally:
        _ACTIVE_BIAS.reset(token)


def biased_sdpa(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    bias: torch.Tensor,
    scaling: float | None = None,
) -> torch.Tensor:
    """sdpa with ``bias`` added to the first ``n`` keys and a causal mask over the last ``q``.

    Parameters
    ----------
    query : ``[B, Hq, q, D]``; key, value : ``[B, Hkv, kv, D]``; bias : ``[B, Hkv, n]``, ``n <= kv``.
    attention_mask : the model's own mask for this call (bool or additive float), or None.

    Returns
    -------
    ``[B, q, Hq, D]``, the layout transformers attention functions return.
    """
    batch, q_heads, q_len, _ = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    group = q_heads // kv_heads
    mask = torch.zeros(batch, q_heads, q_len, kv_len, dtype=query.dtype, device=query.device)
    mask[..., : bias.shape[-1]] += bias.repeat_interleave(group, dim=1).unsqueeze(2).to(query.dtype)
    if q_len > 1:  # the new tokens attend causally among themselves
        future = torch.ones(q_len, q_len, dtype=torch.bool, device=query.device).triu(1)
        mask[..., kv_len - q_len :].masked_fill_(future, float("-inf"))
    if attention_mask is not None and attention_mask.dim() == 4:
        given = attention_mask[..., -kv_len:]
        mask = (
            mask.masked_fill(~given, float("-inf")) if given.dtype == torch.bool else mask + given
        )
    out = F.scaled_dot_product_attention(
        query,
        key.repeat_interleave(group, dim=1),
        value.repeat_interleave(group, dim=1),
        attn_mask=mask,
        scale=scaling,
    )
    return out.transpose(1, 2).contiguous()


def install_bias_attention(model: Any) -> str:
    """Route ``model``'s attention through ``ragsnap_<impl>``; returns the implementation name.

    Idempotent. The wrapper calls the original implementation whenever no bias is active,
    so outputs are unchanged for presses without a bias.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    original = model.config._attn_implementation
    if original.startswith(PREFIX):
        return original
    name = PREFIX + original
    if name not in ALL_ATTENTION_FUNCTIONS:

        def forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):  # type: ignore[no-untyped-def]
            active = _ACTIVE_BIAS.get()
            bias = None if active is None else active.get(module.layer_idx)
            if bias is None:
                inner = (
                    ALL_ATTENTION_FUNCTIONS[original]
                    if original != "eager"  # each model has its own eager (softcapping...)
                    else sys.modules[type(module).__module__].eager_attention_forward
                )
                return inner(
                    module,
                    query,
                    key,
                    value,
                    attention_mask,
                    scaling=scaling,
                    dropout=dropout,
                    **kwargs,
                )
            return biased_sdpa(module, query, key, value, attention_mask, bias, scaling), None

        AttentionInterface.register(name, forward)
        if original in ALL_MASK_ATTENTION_FUNCTIONS:
            AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[original])
    model.set_attn_implementation(name)
    return name
