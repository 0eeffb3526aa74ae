"""Batched forward over rows whose caches differ per layer in length, bias and position.

Each row is one request's compressed (or full) cache. Rows live in per-layer buffers,
right-padded to the longest row of that layer; a forward pass feeds every row its own new
tokens at its own positions, and the registered attention function (``runtime.attention``)
applies one additive mask per layer that hides each row's padding, orders the new tokens
causally, bounds sliding-window layers and adds Attention Matching's per-key bias. The
model is called with a ``DynamicCache`` whose layers write each row's new entries into the
buffers in place, right after that row's own entries (no copy of the cache per step), so
nothing about transformers is patched.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ragsnap.runtime.attention import StepMask, step_masks
from ragsnap.runtime.llama_pass import ChunkFeed, LlamaPass

Layers = Sequence[tuple[torch.Tensor, torch.Tensor]]


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

    @classmethod
    def of_rows(
        cls,
        windows: Sequence[int | None],
        rows: Sequence[Layers],
        positions: Sequence[int],
        reserve: int = 0,
        scratch: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> BatchedKV:
        """A batch of ``rows`` (``[1, Hkv, n_l, D]`` per layer each, no bias) at
        ``positions``, each buffer allocated once with ``reserve`` spare entries.

        ``scratch`` (per layer, keys and values ``[B', Hkv, W', D]``) is memory to reuse:
        where it is large enough the buffers are views of it, and where not it is replaced
        by memory with room to spare (as many rows as it had, its width rounded up to
        ``SCRATCH_ROUNDING`` entries), which the next batches of about that size reuse:
        first use of fresh memory costs more than the copy itself (on a 2-core VM,
        zero-filling 840 MB took 2.3 s)."""
        batch = cls(windows)
        if len(rows) != len(positions) or any(len(r) != len(batch.windows) for r in rows):
            raise ValueError(f"every row needs {len(batch.windows)} layers and a position")
        for i in range(len(batch.windows)):
            k0 = rows[0][i][0]
            width = max(r[i][0].shape[-2] for r in rows) + reserve
            shape = (len(rows), k0.shape[1], width, k0.shape[3])
            old = scratch[i] if scratch is not None and i < len(scratch) else None
            if scratch is not None and (
                old is None or any(a < b for a, b in zip(old[0].shape, shape, strict=True))
            ):
                rows_held = 0 if old is None else old[0].shape[0]
                room = (max(len(rows), rows_held), shape[1], _rounded(width), shape[3])
                old = (k0.new_empty(room), k0.new_empty(room))
                if i < len(scratch):
                    scratch[i] = old
                else:
                    scratch.append(old)
            if old is not None:
                keys, values = (t[: shape[0], :, :width] for t in old)
            else:
                keys, values = k0.new_empty(shape), k0.new_empty(shape)
            for r, row in enumerate(rows):
                n = row[i][0].shape[-2]
                keys[r, :, :n], values[r, :, :n] = row[i][0][0], row[i][1][0]
                keys[r, :, n:], values[r, :, n:] = 0, 0  # padding: masked, but finite
            batch.keys.append(keys)
            batch.values.append(values)
        batch.lengths = torch.tensor([[k.shape[-2] for k, _ in r] for r in rows], dtype=torch.long)
        batch.positions = torch.tensor(list(positions), dtype=torch.long)
        return batch

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

    def compact(self, row: int, layer: int, index: torch.Tensor) -> None:
        """Row ``row`` keeps, per KV head, its entries ``index`` (``[Hkv, m]``, ascending) of
        ``layer``, moved to the front with their bias; the rest of its slice is padding."""
        m = index.shape[-1]
        for buffer in (self.keys[layer], self.values[layer]):
            picked = index.unsqueeze(-1).expand(-1, -1, buffer.shape[-1])
            buffer[row, :, :m] = buffer[row].gather(1, picked)  # [Hkv, m, D]
        bias = self.bias[layer]
        if bias is not None:
            bias[row, :, :m] = bias[row].gather(1, index)
            bias[row, :, m:] = 0  # the row's next entries (its new tokens) have no bias
        self.lengths[row, layer] = m

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

    def masks(self, q_len: int) -> dict[int, StepMask]:
        """Per layer, the additive mask ``[B, Hkv or 1, q, K_l + q]`` of the next pass, where
        ``K_l`` is the longest row of layer ``l``. Row ``r``'s new tokens sit right after its
        own ``n_r`` entries (columns ``n_r .. n_r + q - 1``); columns past them are padding.

        The causal masks are built once per distinct row lengths, all at once (``[U, B, q,
        max K + q]``: a few ops per pass, not per layer); a layer's mask is a view of its
        lengths' slice. Layers that hold as many entries per row (every layer of a prefix,
        of uniform budgets) share one mask: for 8 rows x 40 tokens over 2.4K entries, 30
        layers' masks would be 92 MB of fresh memory per pass."""
        device = self.keys[0].device
        dtype = self.keys[0].dtype
        new_pos = torch.arange(q_len)
        lengths = self.lengths.t()  # [L, B]
        distinct, of_layer = torch.unique(lengths, dim=0, return_inverse=True)  # [U, B], [L]
        widest = lengths.max(dim=1).values.tolist()  # [L]
        cols = torch.arange(max(widest) + q_len)
        # query j of row r sees its row's entries and new tokens up to itself
        limit = distinct.unsqueeze(2) + new_pos  # [U, B, q]
        visible = cols.view(1, 1, 1, -1) <= limit.unsqueeze(3)  # [U, B, q, K + q]
        causal = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))
        causal = causal.to(device).unsqueeze(2)  # [U, B, 1, q, K + q]
        out: dict[int, StepMask] = {}
        for i, (window, width, row_lengths, u) in enumerate(
            zip(self.windows, widest, lengths.tolist(), of_layer.tolist(), strict=True)
        ):
            mask = causal[u, :, :, :, : width + q_len]
            if window is not None:
                # a row's entries end just before its next position, whatever it kept
                cols_l = cols[: width + q_len]
                key_pos = (self.positions - lengths[i]).unsqueeze(1) + cols_l  # [B, K + q]
                query_pos = self.positions.unsqueeze(1) + new_pos  # [B, q]
                near = query_pos.unsqueeze(2) - key_pos.unsqueeze(1) < window
                mask = mask.masked_fill(~near.to(device).unsqueeze(1), float("-inf"))
            bias = self.bias[i]
            if bias is not None:
                mask = mask + bias[:, :, : width + q_len].unsqueeze(2)
            out[i] = StepMask(mask, tuple(n + q_len for n in row_lengths))
        return out

    def model_cache(self, q_len: int) -> Any:
        """A ``DynamicCache`` for a pass of ``q_len`` new tokens per row over the buffers."""
        from transformers import DynamicCache

        self.make_room(q_len)
        cache = DynamicCache()
        cache.layers = [
            _buffer_layer_class()(self, i, int(self.lengths[:, i].max()))
            for i in range(len(self.windows))
        ]
        return cache

    def make_room(self, q_len: int) -> None:
        """Grow every layer's buffers to hold ``q_len`` more entries after its longest row."""
        for i, width in enumerate(self.lengths.max(dim=0).values.tolist()):
            self._grow(i, width + q_len)

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Put the pass's new entries (``[B, Hkv, q, D]``) right after each row's entries."""
        q_len = keys.shape[2]
        if q_len == 1:
            at = self.lengths[:, layer].to(keys.device)
            rows = torch.arange(self.rows, device=keys.device)
            self.keys[layer][rows, :, at] = keys[:, :, 0]
            self.values[layer][rows, :, at] = values[:, :, 0]
            return
        # one slice copy per row: scatter_ over the buffer took 0.45 ms (600 entries per
        # row) to 2.4 ms (3.5K) per call on a CPU, against 25 us for 8 rows' slices
        for row, start in enumerate(self.lengths[:, layer].tolist()):
            self.keys[layer][row, :, start : start + q_len] = keys[row]
            self.values[layer][row, :, start : start + q_len] = values[row]

    def advance(self, counts: Sequence[int]) -> None:
        """After a pass: row ``r`` keeps ``counts[r]`` new entries (the rest was padding)."""
        step = torch.tensor(list(counts), dtype=torch.long)
        self.lengths += step.unsqueeze(1)
        self.positions += step

    def retract(self, row: int, count: int) -> None:
        """Forget row ``row``'s last ``count`` new entries (drafted tokens it did not keep)."""
        if count:
            self.lengths[row] -= count
            self.positions[row] -= count


@functools.cache
def _buffer_layer_class() -> type:
    """The cache layer class over one layer of a :class:`BatchedKV` (built on first use, so
    importing the runtime does not import transformers)."""
    from transformers.cache_utils import DynamicLayer

    class BufferLayer(DynamicLayer):  # type: ignore[misc]
        """``update`` writes the new entries into the batch's buffers in place and returns
        the buffer up to the longest row plus the new tokens; the step mask hides what a
        row does not own."""

        def __init__(self, batch: BatchedKV, layer: int, width: int) -> None:
            super().__init__()
            self.batch, self.layer, self.width = batch, layer, width
            keys, values = batch.keys[layer], batch.values[layer]
            self.lazy_initialization(keys, values)
            self.keys, self.values = keys[:, :, :width], values[:, :, :width]

        def update(self, key_states, value_states, *args, **kwargs):  # type: ignore[no-untyped-def]
            self.batch.write(self.layer, key_states, value_states)
            end = self.width + key_states.shape[2]
            self.keys = self.batch.keys[self.layer][:, :, :end]
            self.values = self.batch.values[self.layer][:, :, :end]
            return self.keys, self.values

    return BufferLayer


# entries a batch's replaced scratch memory is rounded up to (see BatchedKV.of_rows)
SCRATCH_ROUNDING = 512


def _rounded(width: int) -> int:
    return -(-width // SCRATCH_ROUNDING) * SCRATCH_ROUNDING


@dataclass
class DraftPass:
    """A pass a prefix-hit group's draft is about to run (yielded by
    :func:`~ragsnap.runtime.tails.prefill_tails_steps`): ``tokens[r]`` fed to row ``r`` of
    ``batch`` and appended there, each layer's queries (RoPE applied, ``[B, Hq, q, D]``)
    recorded into ``queries``. Its driver may compute it in the same pass as other work
    (the scheduler's decode step, :meth:`~ragsnap.runtime.decode.DecodeBatch.step`) and
    set ``logits`` (``[B, q, V]``); else the draft computes it alone when it goes on."""

    batch: BatchedKV
    tokens: list[list[int]]
    queries: dict[int, list[torch.Tensor]]
    logits: torch.Tensor | None = None


@torch.inference_mode()
def forward_rows(
    model: Any,
    cache_kwarg: str,
    batch: BatchedKV,
    tokens: Sequence[Sequence[int]],
    *,
    last: bool,
    lean: LlamaPass | None = None,
    queries: dict[int, list[torch.Tensor]] | None = None,
) -> torch.Tensor:
    """Feed row ``r`` the tokens ``tokens[r]`` at its own next positions and append them.

    Returns the logits of each row's last new token ``[B, V]`` when ``last``, else every
    position's ``[B, q, V]`` (row ``r``'s first ``len(tokens[r])`` are meaningful). Rows
    with fewer tokens are padded; a padded query only sees its own row's keys, so it
    stays finite, and its entries are not kept. With ``lean`` (the model's
    :class:`~ragsnap.runtime.llama_pass.LlamaPass`) the pass skips transformers' module
    tree; forward hooks and attention observers then see nothing of it, and ``queries``
    records each layer's queries instead (see :meth:`LlamaPass.lanes`).
    """
    if lean is not None:
        return forward_lanes(lean, [batch], [tokens], last=last, queries=[queries])[0]
    if queries is not None:
        raise ValueError("queries are recorded by the lean pass only")
    counts = [len(t) for t in tokens]
    if len(counts) != batch.rows or min(counts, default=0) < 1:
        raise ValueError("every row needs at least one new token")
    q_len = max(counts)
    device = batch.keys[0].device
    ids = torch.tensor([list(t) + [t[-1]] * (q_len - len(t)) for t in tokens], device=device)
    positions = (batch.positions.unsqueeze(1) + torch.arange(q_len)).to(device)
    equal = len(set(counts)) == 1
    cache = batch.model_cache(q_len)
    with step_masks(batch.masks(q_len)):
        logits = model(
            input_ids=ids,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1 if last and equal else 0,
            **{cache_kwarg: cache},
        ).logits
    batch.advance(counts)
    if not last:
        return logits
    if equal:
        return logits[:, -1]
    index = torch.tensor(counts, device=logits.device) - 1
    return logits[torch.arange(len(counts), device=logits.device), index]


@torch.inference_mode()
def forward_lanes(
    lean: LlamaPass,
    batches: Sequence[BatchedKV],
    tokens: Sequence[Sequence[Sequence[int]]],
    *,
    last: bool | Sequence[bool],
    chunk: ChunkFeed | None = None,
    queries: Sequence[dict[int, list[torch.Tensor]] | None] = (),
) -> list[torch.Tensor]:
    """:func:`forward_rows` of several batches in one lean pass (``tokens[j][r]`` for row
    ``r`` of batch ``j``, ``last[j]`` or ``last`` for all): the linears read their weights
    once for every row, each batch attends over its own buffers; ``chunk``, a prompt chunk
    computed in the same pass (see :meth:`LlamaPass.lanes`). ``queries[j]`` records batch
    ``j``'s queries (``[B_j, Hq, q, D]`` per layer, as :func:`forward_rows` does). Returns,
    per batch, what :func:`forward_rows` would."""
    counts = [[len(t) for t in rows] for rows in tokens]
    if any(len(c) != b.rows or min(c, default=0) < 1 for c, b in zip(counts, batches, strict=True)):
        raise ValueError("every row needs at least one new token")
    lasts = [last] * len(batches) if isinstance(last, bool) else list(last)
    q_len = max(n for c in counts for n in c)
    device = batches[0].keys[0].device
    flat = [list(t) + [t[-1]] * (q_len - len(t)) for rows in tokens for t in rows]
    ids = torch.tensor(flat, device=device)
    positions = torch.cat([b.positions.unsqueeze(1) + torch.arange(q_len) for b in batches])
    equal = len({n for c in counts for n in c}) == 1
    for batch in batches:
        batch.make_room(q_len)
    lanes = [(batch, batch.masks(q_len)) for batch in batches]
    recorded: dict[int, list[torch.Tensor]] | None = (
        {} if any(q is not None for q in queries) else None
    )
    logits = lean.lanes(
        lanes,
        ids,
        positions.to(device),
        last_only=all(lasts) and equal,
        chunk=chunk,
        queries=recorded,
    )
    out, start = [], 0
    for j, (batch, c) in enumerate(zip(batches, counts, strict=True)):
        part = logits[start : start + len(c)]
        record = queries[j] if j < len(queries) else None
        if recorded is not None and record is not None:
            for layer, per_pass in recorded.items():
                record.setdefault(layer, []).append(per_pass[0][start : start + len(c)])
        start += len(c)
        batch.advance(c)
        if not lasts[j]:
            out.append(part)
        elif part.shape[1] == 1:
            out.append(part[:, -1])
        else:
            index = torch.tensor(c, device=part.device) - 1
            out.append(part[torch.arange(len(c), device=part.device), index])
    return out
