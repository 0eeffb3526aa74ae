"""Small helpers over transformers KV caches."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ragsnap.compression import CompressedLayer


def cache_nbytes(cache: Any) -> int:
    """Bytes held by the keys and values of every layer of a transformers cache."""
    return sum(
        layer.keys.nbytes + layer.values.nbytes
        for layer in cache.layers
        if getattr(layer, "keys", None) is not None and layer.keys.numel() > 0
    )


def derive_cache(base: Any, replacements: Mapping[int, CompressedLayer] | None = None) -> Any:
    """A new cache sharing ``base``'s tensors, with the layers in ``replacements`` swapped
    for their compressed entries.

    Cache layers append with ``torch.cat`` (a new tensor), so decoding on the derived
    cache never changes ``base``: one prefill can serve several presses and replays.
    """
    derived = copy.copy(base)
    derived.layers = []
    for i, layer in enumerate(base.layers):
        clone = copy.copy(layer)
        if replacements is not None and i in replacements:
            clone.keys, clone.values = replacements[i].keys, replacements[i].values
        derived.layers.append(clone)
    return derived


def cache_from_layers(config: Any, layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """A model cache holding ``layers`` (``[1, Hkv, n_l, D]`` each) as they are.

    Plain dynamic layers take the tensors without a copy; sliding layers keep extra
    counters, so they account for the entries through their own ``update``.
    """
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=config)
    for layer, (k, v) in zip(cache.layers, layers, strict=True):
        if type(layer) is DynamicLayer:
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
        else:
            layer.update(k, v)  # type: ignore[union-attr]
    return cache


def crop_layers(
    layers: Sequence[tuple[torch.Tensor, torch.Tensor]], length: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first ``length`` positions of ``layers`` (``[1, Hkv, n, D]`` per layer), as views."""
    with torch.inference_mode():
        return [(k[:, :, :length], v[:, :, :length]) for k, v in layers]


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
