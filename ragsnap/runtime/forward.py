"""Batched forward over rows whose caches differ per layer in length, bias and position.

Each row is one request's compressed (or full) cache. Rows live in per-layer buffers,
right-padded to the longest row of that layer; a forward pass feeds every row its own new
tokens at its own positions, and the registered attention function (``runtime.attention``)
applies one additive mask per layer that hides each row's padding, orders the new tokens
causally, bounds sliding-window layers and adds Attention Matching's per-key bias. The
model itself is called through a plain ``DynamicCache`` whose layers view the buffers, so
nothing about transformers is patched.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ragsnap.runtime.attention import step_masks

Layers = Sequence[tuple[torch.Tensor, torch.Tensor]]


def sliding_windows(config: Any) -> list[int | None]:
    """Per layer: the sliding window of a sliding-attention layer, else None."""
    config = getattr(config, "get_text_config", lambda: config)()
    layers = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not window:
        return [None] * layers
    if types is None:  # Mistral-style: every layer slides
        return [int(window)] * layers
    return [int(window) if t == "sliding_attention" else None for t in types]


class BatchedKV:
    """The caches of ``rows`` requests, one buffer per layer.

    ``keys[l]`` / ``values[l]`` are ``[B, Hkv, capacity_l, D]``; row ``r`` holds its
    ``lengths[r, l]`` entries at the front of its slice. ``bias[l]`` is ``[B, Hkv,
    capacity_l]`` (zeros where a key has none) or None when no row biases that layer.
    ``positions[r]`` is the position of row ``r``'s next token (its original prompt length
    plus what it generated, whatever the cache kept). Entries of a sliding layer are the
    row's most recent positions, contiguous up to ``positions[r] - 1``.
    """

    def __init__(self, windows: Sequence[int | None]) -> None:
        self.windows = list(windows)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.bias: list[torch.Tensor | None] = [None] * len(self.windows)
        self.lengths = torch.zeros(0, len(self.windows), dtype=torch.long)
        self.positions = torch.zeros(0, dtype=torch.long)

    @property
    def rows(self) -> int:
        return int(self.positions.shape[0])

    def nbytes(self) -> int:
        """Bytes of the entries the rows hold (padding and spare capacity excluded)."""
        per_entry = [k.shape[1] * k.shape[3] * k.element_size() * 2 for k in self.keys]
        return int(sum(int(self.lengths[:, i].sum()) * b for i, b in enumerate(per_entry)))

    def add(
        self,
        layers: Layers,
        position: int,
        bias: Mapping[int, torch.Tensor] | None = None,
        reserve: int = 0,
    ) -> int:
        """Append a row holding ``layers`` (``[1, Hkv, n_l, D]`` each); returns its index.

        ``bias[l]`` is ``[1, Hkv, n_b]`` for the first ``n_b`` keys of layer ``l``;
        ``reserve`` entries of spare capacity avoid regrowing while the row decodes.
        """
        bias = bias or {}
        if len(layers) != len(self.windows):
            raise ValueError(f"a row needs {len(self.windows)} layers, got {len(layers)}")
        first = not self.keys
        for i, (k, v) in enumerate(layers):
            n = k.shape[-2]
            if first:
                shape = (0, k.shape[1], n + reserve, k.shape[3])
                self.keys.append(k.new_zeros(shape))
                self.values.append(v.new_zeros(shape))
            self._grow(i, n + reserve)
            row_k = self.keys[i].new_zeros((1, *self.keys[i].shape[1:]))
            row_v = torch.zeros_like(row_k)
            row_k[:, :, :n], row_v[:, :, :n] = k, v
            self.keys[i] = torch.cat([self.keys[i], row_k])
            self.values[i] = torch.cat([self.values[i], row_v])
            old = self.bias[i]
            if i in bias or old is not None:
                row_b = row_k.new_zeros(row_k.shape[:3])
                if i in bias:
                    row_b[:, :, : bias[i].shape[-1]] = bias[i]
                if old is None:
                    old = row_k.new_zeros((self.rows, *row_k.shape[1:3]))
                self.bias[i] = torch.cat([old, row_b])
        row_lengths = torch.tensor([[k.shape[-2] for k, _ in layers]], dtype=torch.long)
        self.lengths = torch.cat([self.lengths, row_lengths])
        self.positions = torch.cat([self.positions, torch.tensor([position])])
        return self.rows - 1

    def keep(self, rows: Sequence[int]) -> None:
        """Keep only ``rows`` (in that order); the others leave the batch."""
        index = torch.tensor(list(rows), dtype=torch.long)
        device_index = index.to(self.keys[0].device) if self.keys else index
        self.keys = [k.index_select(0, device_index) for k in self.keys]
        self.values = [v.index_select(0, device_index) for v in self.values]
        self.bias = [None if b is None else b.index_select(0, device_index) for b in self.bias]
        self.lengths = self.lengths.index_select(0, index)
        self.positions = self.positions.index_select(0, index)

    def _grow(self, layer: int, needed: int) -> None:
        capacity = self.keys[layer].shape[2]
        if needed <= capacity:
            return
        extra = max(needed, 2 * capacity) - capacity
        pad = lambda t: torch.nn.functional.pad(t, (0, 0, 0, extra))  # noqa: E731
        self.keys[layer], self.values[layer] = pad(self.keys[layer]), pad(self.values[layer])
        bias = self.bias[layer]
        if bias is not None:
            self.bias[layer] = torch.nn.functional.pad(bias, (0, extra))

    def row_layers(self, row: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Row ``row``'s entries per layer, ``[1, Hkv, n_l, D]`` (views of the buffers)."""
        out = []
        for i in range(len(self.windows)):
            n = int(self.lengths[row, i])
            out.append((self.keys[i][row : row + 1, :, :n], self.values[i][row : row + 1, :, :n]))
        return out

    # -- one forward pass --------------------------------------------------------------

    def masks(self, q_len: int) -> dict[int, torch.Tensor]:
        """Per layer, the additive mask ``[B, Hkv or 1, q, K_l + q]`` of the next pass, where
        ``K_l`` is the longest row of layer ``l`` and the new tokens follow it."""
        device = self.keys[0].device
        dtype = self.keys[0].dtype
        new_pos = torch.arange(q_len)
        causal = new_pos.unsqueeze(1) >= new_pos.unsqueeze(0)  # [q, q]
        out: dict[int, torch.Tensor] = {}
        for i, window in enumerate(self.windows):
            lengths = self.lengths[:, i]
            width = int(lengths.max())
            cols = torch.arange(width)
            visible = (cols.unsqueeze(0) < lengths.unsqueeze(1)).unsqueeze(1)  # [B, 1, K]
            visible = torch.cat(
                [visible.expand(-1, q_len, -1), causal.expand(self.rows, -1, -1)], dim=-1
            )  # [B, q, K + q]
            if window is not None:
                # key positions: the row's entries end just before its next position
                key_pos = torch.cat(
                    [
                        self.positions.unsqueeze(1) - lengths.unsqueeze(1) + cols,
                        self.positions.unsqueeze(1) + new_pos,
                    ],
                    dim=1,
                )  # [B, K + q]
                query_pos = self.positions.unsqueeze(1) + new_pos  # [B, q]
                near = query_pos.unsqueeze(2) - key_pos.unsqueeze(1) < window
                visible &= near
            mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))
            mask = mask.to(device).unsqueeze(1)  # [B, 1, q, K + q]
            bias = self.bias[i]
            if bias is not None:
                mask = mask + torch.nn.functional.pad(bias[:, :, :width], (0, q_len)).unsqueeze(2)
            out[i] = mask
        return out

    def model_cache(self) -> Any:
        """A ``DynamicCache`` whose layers view the buffers up to each layer's longest row."""
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        cache = DynamicCache()
        cache.layers = []
        for i in range(len(self.windows)):
            width = int(self.lengths[:, i].max())
            layer = DynamicLayer()
            k, v = self.keys[i][:, :, :width], self.values[i][:, :, :width]
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
            cache.layers.append(layer)
        return cache

    def append(self, cache: Any, counts: Sequence[int]) -> None:
        """Move the new entries the pass appended to ``cache`` into each row's buffer;
        ``counts[r]`` of them are row ``r``'s (the rest were query padding)."""
        q_len = max(counts)
        for i, layer in enumerate(cache.layers):
            width = layer.keys.shape[2] - q_len
            self._grow(i, int(self.lengths[:, i].max()) + q_len)
            new_k, new_v = layer.keys[:, :, width:], layer.values[:, :, width:]
            if q_len == 1:
                rows = torch.arange(self.rows, device=new_k.device)
                at = self.lengths[:, i].to(new_k.device)
                self.keys[i][rows, :, at] = new_k[:, :, 0]
                self.values[i][rows, :, at] = new_v[:, :, 0]
            else:
                for r, n in enumerate(counts):
                    begin = int(self.lengths[r, i])
                    self.keys[i][r, :, begin : begin + n] = new_k[r, :, :n]
                    self.values[i][r, :, begin : begin + n] = new_v[r, :, :n]
        step = torch.tensor(list(counts), dtype=torch.long)
        self.lengths += step.unsqueeze(1)
        self.positions += step


@torch.inference_mode()
def forward_rows(
    model: Any, cache_kwarg: str, batch: BatchedKV, tokens: Sequence[Sequence[int]], *, last: bool
) -> torch.Tensor:
    """Feed row ``r`` the tokens ``tokens[r]`` at its own next positions and append them.

    Returns the logits of each row's last new token ``[B, V]`` when ``last``, else every
    position's ``[B, q, V]`` (row ``r``'s first ``len(tokens[r])`` are meaningful). Rows
    with fewer tokens are padded; a padded query only sees its own row's keys, so it
    stays finite, and its entries are not kept.
    """
    counts = [len(t) for t in tokens]
    if len(counts) != batch.rows or min(counts, default=0) < 1:
        raise ValueError("every row needs at least one new token")
    q_len = max(counts)
    device = batch.keys[0].device
    ids = torch.tensor([list(t) + [t[-1]] * (q_len - len(t)) for t in tokens], device=device)
    positions = (batch.positions.unsqueeze(1) + torch.arange(q_len)).to(device)
    cache = batch.model_cache()
    equal = len(set(counts)) == 1
    with step_masks(batch.masks(q_len)):
        out = model(
            input_ids=ids,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1 if last and equal else 0,
            **{cache_kwarg: cache},
        )
    batch.append(cache, counts)
    logits = out.logits
    if not last:
        return logits
    if equal:
        return logits[:, -1]
    index = torch.tensor(counts, device=logits.device) - 1
    return logits[torch.arange(len(counts), device=logits.device), index]
