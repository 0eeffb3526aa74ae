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
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ragsnap.runtime.attention import StepMask, masked_sdpa
from ragsnap.runtime.causal_sdpa import causal_chunk_sdpa
from ragsnap.runtime.kv import sliding_windows
from ragsnap.runtime.loading.bf16_matmuls import BF16_MATMULS
from ragsnap.runtime.loading.fused_projections import fused_linear

# decoder layer classes whose forward is the one in the module docstring
LLAMA_LAYERS = frozenset({"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer"})


@dataclass
class ChunkFeed:
    """A chunk of one prompt's prefill computed in a decode step's pass (see
    :meth:`LlamaPass.lanes`): ``ids`` at positions ``begin ..`` on top of ``cache`` (a
    transformers cache holding the prompt's first ``begin`` positions), its keys and values
    appended there. ``done`` is set once the pass has computed it. No logits, unless
    ``queries`` is given (a pass of the prompt's lookahead draft): then each layer's
    queries of the chunk (RoPE applied, ``[1, Hq, n, D]`` float) are appended to
    ``queries[layer]`` and ``logits`` (``[n, V]``, every position's) is set."""

    ids: Sequence[int]
    cache: Any
    begin: int
    done: bool = False
    queries: dict[int, list[torch.Tensor]] | None = None
    logits: torch.Tensor | None = None


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


def computes_chunks(model: Any) -> bool:
    """Whether :meth:`LlamaPass.lanes` may compute a prompt chunk of ``model``: on a CPU,
    with no sliding-window layer (a chunk attends causally over its whole cache) and no
    attention layer rounding document products to bfloat16 (``medium`` matmul
    precision routes those through the module tree's attention)."""
    if next(model.parameters()).device.type != "cpu" or any(sliding_windows(model.config)):
        return False
    return not any(getattr(layer.self_attn, BF16_MATMULS, False) for layer in model.model.layers)


class LlamaPass:
    """The pass of :func:`llama_pass_for` over one model. It reads the model's modules at
    every call (never copies of them), so it follows a model whose linears are swapped
    (packed or unpacked) after it was made."""

    def __init__(self, model: Any) -> None:
        self.model = model
        attention = model.model.layers[0].self_attn
        self.head_dim = int(attention.head_dim)
        self.scaling = float(attention.scaling)

    def chunk(self, feed: ChunkFeed) -> None:
        """Compute ``feed`` alone (:meth:`lanes` with no rows): a prefill chunk or draft
        pass without the module tree's per-module costs (a 2.2K-token prompt in 512-token
        chunks, embedded model, 2 threads: 1.22-1.27 s against 1.27-1.36 s, the same keys
        and values)."""
        none = torch.empty(0, 0, dtype=torch.long)
        self.lanes((), none, none, last_only=True, chunk=feed)

    @torch.inference_mode()
    def lanes(
        self,
        lanes: Sequence[tuple[Any, Mapping[int, StepMask]]],
        ids: torch.Tensor,
        positions: torch.Tensor,
        last_only: bool,
        chunk: ChunkFeed | None = None,
        queries: dict[int, list[torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """Feed ``ids`` ``[B, q]`` at ``positions`` ``[B, q]`` to the rows of every batch of
        ``lanes`` (each a :class:`~ragsnap.runtime.forward.BatchedKV` with room for ``q``
        more entries per row and layer, with its masks), their rows one batch after the
        other (``B = B_1 + B_2 + ...``): the linears run once over every row; each batch's
        rows write each layer's new entries after their own (``batch.write``) and attend
        with ``masks[l]`` over layer ``l``'s buffer up to ``K_l + q``. Returns logits
        ``[B, 1, V]`` for the last position when ``last_only``, else ``[B, q, V]``.
        Advancing the rows' lengths is the caller's. ``queries``: each layer's queries
        (RoPE applied, ``[B, Hq, q, D]`` float) are appended to ``queries[layer]``, as
        :func:`~ragsnap.compression.hooks.query_capture` records them from the module tree.

        ``chunk``: a prompt chunk that rides along (CPU only): its tokens go through the
        same linears, beside the rows' (the weights are read once for both), attend
        causally over its own cache and are appended there; its logits and queries only
        when it asks (:class:`ChunkFeed`). A decode step then costs the prefill little more
        than its rows' tokens."""
        inner = self.model.model
        b, q_len = ids.shape
        rows = b * q_len
        d = self.head_dim
        bounds, start = [], 0
        for batch, _ in lanes:
            bounds.append((start, start + batch.rows))
            start += batch.rows
        flat_ids, flat_positions = ids.reshape(-1), positions.reshape(-1)
        if chunk is not None:
            span = torch.arange(chunk.begin, chunk.begin + len(chunk.ids), device=ids.device)
            flat_ids = torch.cat([flat_ids, torch.tensor(list(chunk.ids), device=ids.device)])
            flat_positions = torch.cat([flat_positions, span])
        total = flat_ids.shape[0]
        # every token, the rows' then the chunk's, one after the other: [1, T, H]
        hidden = inner.embed_tokens(flat_ids.unsqueeze(0))
        cos, sin = inner.rotary_emb(hidden, flat_positions.unsqueeze(0))  # [1, T, D]
        cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)  # [T, 1, D]
        for i, layer in enumerate(inner.layers):
            attention, mlp = layer.self_attn, layer.mlp
            x = _rms_norm(hidden, layer.input_layernorm)
            query, key, value = self._projections(attention, x, total, cos, sin)
            heads, kv_heads = query.shape[1], key.shape[1]
            row_query = query[:rows].view(b, q_len, heads, d).transpose(1, 2)  # [B, Hq, q, D]
            if queries is not None:
                queries.setdefault(i, []).append(row_query.float())
            row_key = key[:rows].view(b, q_len, kv_heads, d).transpose(1, 2)  # [B, Hkv, q, D]
            row_value = value[:rows].view(b, q_len, kv_heads, d).transpose(1, 2)
            outs = []
            for (batch, masks), (first, end) in zip(lanes, bounds, strict=True):
                batch.write(i, row_key[first:end], row_value[first:end])
                mask = masks[i]
                width = mask.mask.shape[-1]
                outs.append(
                    masked_sdpa(
                        row_query[first:end],
                        batch.keys[i][:, :, :width],
                        batch.values[i][:, :, :width],
                        mask.mask,
                        self.scaling,
                        mask.widths,
                    ).reshape(-1, heads * d)
                )  # [B_lane * q, Hq * D]
            if chunk is not None:
                if chunk.queries is not None:
                    chunk.queries.setdefault(i, []).append(_chunk(query, rows).float())
                if chunk.cache.get_seq_length(i) != chunk.begin:  # the kernel needs it so
                    raise ValueError(
                        f"layer {i} holds {chunk.cache.get_seq_length(i)} entries, not the "
                        f"{chunk.begin} positions before the chunk"
                    )
                keys, values = chunk.cache.update(_chunk(key, rows), _chunk(value, rows), i)
                out = causal_chunk_sdpa(
                    _chunk(query, rows), keys, values, chunk.begin, self.scaling
                )
                outs.append(out[0].transpose(0, 1).reshape(-1, heads * d))
            out = outs[0] if len(outs) == 1 else torch.cat(outs)
            hidden = hidden + attention.o_proj(out.unsqueeze(0))
            x = _rms_norm(hidden, layer.post_attention_layernorm)
            hidden = hidden + mlp.down_proj(self._gated(mlp, x))
        if chunk is not None:
            chunk.done = True
            if chunk.queries is not None:
                chunk.logits = self.model.lm_head(_rms_norm(hidden[0, rows:], inner.norm))
        if not rows:  # a chunk alone
            return hidden.new_empty(0)
        hidden = hidden[0, :rows].view(b, q_len, hidden.shape[-1])
        if last_only:
            hidden = hidden[:, -1:]
        return self.model.lm_head(_rms_norm(hidden, inner.norm))

    def _projections(
        self, attention: Any, x: torch.Tensor, total: int, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries ``[T, Hq, D]`` and keys ``[T, Hkv, D]`` (RoPE applied) and values
        ``[T, Hkv, D]`` of the layer input ``x`` ``[1, T, H]``; one product and one RoPE
        for the queries and keys together where the projections are fused."""
        d = self.head_dim
        fused = fused_linear(attention, "qkv_proj")
        if fused is None:
            query = attention.q_proj(x).view(total, -1, d)
            key = attention.k_proj(x).view(total, -1, d)
            value = attention.v_proj(x).view(total, -1, d)
            return (
                query * cos + _rotate_half(query) * sin,
                key * cos + _rotate_half(key) * sin,
                value,
            )
        q_width = attention.q_proj.out_features
        qkv = fused(x)[0]  # [T, Hq * D + 2 * Hkv * D]
        key_end = q_width + attention.k_proj.out_features
        qk = qkv[:, :key_end].view(total, -1, d)  # [T, Hq + Hkv, D]
        qk = qk * cos + _rotate_half(qk) * sin
        heads = q_width // d
        return qk[:, :heads], qk[:, heads:], qkv[:, key_end:].view(total, -1, d)

    @staticmethod
    def _gated(mlp: Any, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate_proj(x)) * up_proj(x)`` ``[1, T, I]``, one product where fused."""
        fused = fused_linear(mlp, "gate_up_proj")
        if fused is None:
            return F.silu(mlp.gate_proj(x)) * mlp.up_proj(x)
        gate_up = fused(x)
        width = gate_up.shape[-1] // 2
        return F.silu(gate_up[..., :width]) * gate_up[..., width:]


def _chunk(x: torch.Tensor, rows: int) -> torch.Tensor:
    """The chunk's part of ``x`` (``[T, H, D]``, the rows' first ``rows`` tokens) as one
    prompt's heads: ``[1, H, T - rows, D]``."""
    return x[rows:].transpose(0, 1).unsqueeze(0)


def _rms_norm(x: torch.Tensor, norm: Any) -> torch.Tensor:
    """A Llama RMSNorm module's output (``weight * x / rms(x)``, last dimension, float32)."""
    y = F.rms_norm(x.float(), (x.shape[-1],), eps=norm.variance_epsilon)
    return norm.weight * y.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[-x2, x1]`` for ``x = [x1, x2]`` halved on the last dimension."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
