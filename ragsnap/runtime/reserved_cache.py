"""Prefill caches that append in place, into memory reserved for the whole prompt.

transformers' dynamic cache layers append with ``torch.cat``: every prefill chunk and every
drafted token copies the layer's whole cache. For the embedded model at 2.2K tokens that is
~100 MB over its 30 layers, 40-55 ms per append on a 2-core VM: two thirds of the cost of a
token drafted by the lookahead press. During a prefill the final length is known (the prompt
plus the drafted tokens), so :func:`reserved` lets the cache's plain layers write into
buffers of that length instead. Entries a layer starts with (a loaded document prefix) are
copied into its own buffer on its first append: memory the layer did not allocate is never
written. Afterwards the layers are plain dynamic layers again, holding views of the buffers,
so later appends copy as before and caches derived from one prefill stay independent.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


@contextmanager
def reserved(cache: Any, capacity: int) -> Iterator[Any]:
    """Within the block, ``cache``'s plain dynamic layers append in place into buffers of
    ``capacity`` positions (``[B, Hkv, capacity, D]``; grown by copying if exceeded).
    Sliding-window and other layer types are left as they are."""
    from transformers.cache_utils import DynamicLayer

    layer_class = _reserved_layer_class()
    swapped = []
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer:
            cache.layers[i] = layer_class.replacing(layer, capacity)
            swapped.append(i)
    try:
        yield cache
    finally:
        for i in swapped:
            cache.layers[i] = cache.layers[i].released()


@functools.cache
def _reserved_layer_class() -> Any:
    """The reserved layer class (built on first use: importing the runtime does not import
    transformers)."""
    from transformers.cache_utils import DynamicLayer

    class ReservedLayer(DynamicLayer):  # type: ignore[misc]
        """A dynamic layer whose ``keys`` / ``values`` are views of its own buffers."""

        capacity: int
        buffers: tuple[torch.Tensor, torch.Tensor] | None

        @classmethod
        def replacing(cls, layer: Any, capacity: int) -> ReservedLayer:
            reserved = cls()
            reserved.__dict__.update(layer.__dict__)
            reserved.capacity, reserved.buffers = capacity, None
            return reserved

        def released(self) -> Any:
            plain = DynamicLayer()
            plain.__dict__.update(
                {k: v for k, v in self.__dict__.items() if k not in ("capacity", "buffers")}
            )
            return plain

        def update(self, key_states, value_states, *args, **kwargs):  # type: ignore[no-untyped-def]
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            start = self.get_seq_length()
            end = start + key_states.shape[-2]
            if not self._holds(end, key_states, value_states):
                self._rebuffer(start, end, key_states, value_states)
            assert self.buffers is not None
            keys, values = self.buffers
            keys[:, :, start:end].copy_(key_states)
            values[:, :, start:end].copy_(value_states)
            self.keys, self.values = keys[:, :, :end], values[:, :, :end]
            return self.keys, self.values

        def _holds(self, end: int, key_states: torch.Tensor, value_states: torch.Tensor) -> bool:
            """Whether the buffers exist, fit ``end`` entries and hold the current ones."""
            if self.buffers is None:
                return False
            keys, values = self.buffers
            held_keys, held_values = self.keys, self.values
            assert held_keys is not None and held_values is not None  # initialized by update
            return (
                end <= keys.shape[2]
                and keys.shape[:2] == key_states.shape[:2]
                and values.shape[3] == value_states.shape[3]
                and keys.dtype == key_states.dtype
                and (held_keys.numel() == 0 or held_keys.data_ptr() == keys.data_ptr())
                and (held_values.numel() == 0 or held_values.data_ptr() == values.data_ptr())
            )

        def _rebuffer(
            self, start: int, end: int, key_states: torch.Tensor, value_states: torch.Tensor
        ) -> None:
            size = max(end, self.capacity)
            keys = key_states.new_empty((*key_states.shape[:2], size, key_states.shape[3]))
            values = value_states.new_empty((*value_states.shape[:2], size, value_states.shape[3]))
            if start:
                assert self.keys is not None and self.values is not None
                keys[:, :, :start].copy_(self.keys)
                values[:, :, :start].copy_(self.values)
            self.buffers = (keys, values)

    return ReservedLayer
