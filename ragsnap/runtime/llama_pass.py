"""The batched pass of a Llama-family decoder, computed straight from its weights.

A decode step of a few rows does little arithmetic per module, so calling transformers'
module tree (decoder layers, attention, MLP, norms, rotary helpers, the attention-function
and cache interfaces, keyword plumbing) costs as much as the GEMMs themselves: on the
embedded model, 4 rows on one CPU thread, about 23 ms of a 58 ms step. This pass runs the
same computation with the model's own parameters and linear modules, layer after layer:

    h = embed(ids)
    per layer:  x = rmsnorm(h);  q, k, v = rope(q_proj(x), k_proj(x)), v_proj(x)
                h += o_proj(sdpa(q, [cache; k], [cache; v], step mask))
                x = rmsnorm(h);  h += down_proj(silu(gate_proj(x)) * up_proj(x))
    logits = lm_head(rmsnorm(h))

It applies to decoders whose layers are exactly that (Llama, Mistral, Qwen2; checked by
:func:`llama_pass_for`), and it is only used where nothing observes the attention (decode
compression records it through transformers' path). Its logits match the module tree's up
to float rounding (tests/test_llama_pass.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ragsnap.runtime.attention import StepMask, masked_sdpa

# decoder layer classes whose forward is the one in the module docstring
LLAMA_LAYERS = frozenset({"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer"})


def llama_pass_for(model: Any) -> LlamaPass | None:
    """The lean pass for ``model``, or None when its layers are not plain Llama layers."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    config = getattr(model, "config", None)
    if inner is None or not layers or config is None:
        return None
    if any(type(layer).__name__ not in LLAMA_LAYERS for layer in layers):
        return None
    if getattr(config, "hidden_act", None) != "silu" or not hasattr(model, "lm_head"):
        return None
    return LlamaPass(model)


class LlamaPass:
    """The pass of :func:`llama_pass_for` over one model. It reads the model's modules at
    every call (never copies of them), so it follows a model whose linears are swapped
    (packed or unpacked) after it was made."""

    def __init__(self, model: Any) -> None:
        self.model = model
        attention = model.model.layers[0].self_attn
        self.head_dim = int(attention.head_dim)
        self.scaling = float(attention.scaling)

    def __call__(
        self,
        batch: Any,
        ids: torch.Tensor,
        positions: torch.Tensor,
        masks: Mapping[int, StepMask],
        last_only: bool,
    ) -> torch.Tensor:
        """Feed ``ids`` ``[B, q]`` at ``positions`` ``[B, q]`` to the rows of ``batch`` (a
        :class:`~ragsnap.runtime.forward.BatchedKV` with room for ``q`` more entries per row
        and layer), writing each layer's new entries after each row's own (``batch.write``)
        and attending with ``masks[l]`` over layer ``l``'s buffer up to ``K_l + q``. Returns
        logits ``[B, 1, V]`` for the last position when ``last_only``, else ``[B, q, V]``.
        Advancing the rows' lengths is the caller's.
        """
        return self.lanes([(batch, masks)], ids, positions, last_only)

    @torch.inference_mode()
    def lanes(
        self,
        lanes: Sequence[tuple[Any, Mapping[int, StepMask]]],
        ids: torch.Tensor,
        positions: torch.Tensor,
        last_only: bool,
    ) -> torch.Tensor:
        """:meth:`__call__` over several batches at once: ``ids`` and ``positions`` hold
        their rows one batch after the other (``[B_1 + B_2 + ..., q]``); the linears run
        once over every row, and each batch's rows attend over its own buffers with its own
        masks. Returns the logits of every row, in that order."""
        inner = self.model.model
        b, q_len = ids.shape
        d = self.head_dim
        bounds, start = [], 0
        for batch, _ in lanes:
            bounds.append((start, start + batch.rows))
            start += batch.rows
        hidden = inner.embed_tokens(ids)  # [B, q, H]
        cos, sin = inner.rotary_emb(hidden, positions)  # [B, q, D]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, q, D]
        for i, layer in enumerate(inner.layers):
            attention, mlp = layer.self_attn, layer.mlp
            x = _rms_norm(hidden, layer.input_layernorm)
            query = attention.q_proj(x).view(b, q_len, -1, d).transpose(1, 2)  # [B, Hq, q, D]
            key = attention.k_proj(x).view(b, q_len, -1, d).transpose(1, 2)  # [B, Hkv, q, D]
            value = attention.v_proj(x).view(b, q_len, -1, d).transpose(1, 2)
            query = query * cos + _rotate_half(query) * sin
            key = key * cos + _rotate_half(key) * sin
            outs = []
            for (batch, masks), (first, end) in zip(lanes, bounds, strict=True):
                batch.write(i, key[first:end], value[first:end])
                mask = masks[i]
                width = mask.mask.shape[-1]
                outs.append(
                    masked_sdpa(
                        query[first:end],
                        batch.keys[i][:, :, :width],
                        batch.values[i][:, :, :width],
                        mask.mask,
                        self.scaling,
                        mask.widths,
                    )
                )  # [B_lane, q, Hq, D]
            out = outs[0] if len(outs) == 1 else torch.cat(outs)
            hidden = hidden + attention.o_proj(out.view(b, q_len, -1))
            x = _rms_norm(hidden, layer.post_attention_layernorm)
            hidden = hidden + mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
        if last_only:
            hidden = hidden[:, -1:]
        return self.model.lm_head(_rms_norm(hidden, inner.norm))


def _rms_norm(x: torch.Tensor, norm: Any) -> torch.Tensor:
    """A Llama RMSNorm module's output (``weight * x / rms(x)``, last dimension, float32)."""
    y = F.rms_norm(x.float(), (x.shape[-1],), eps=norm.variance_epsilon)
    return norm.weight * y.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[-x2, x1]`` for ``x = [x1, x2]`` halved on the last dimension."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
