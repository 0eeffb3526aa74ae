"""Moving cached keys to new positions: RoPE re-encoding with the model's own rotary embedding.

Rotary attention rotates each key by an angle proportional to its position, so a key
computed at position ``p`` becomes the key at ``p + d`` by one more rotation by ``d``
(rotations compose). The cos/sin of that rotation come from the model's rotary module
(``rotary_emb(x, position_ids)``), so its frequencies, scaling type and layout are the
model's. Where the position -> angle map is not linear (dynamic NTK, LongRoPE), only part of
the head is rotated, or the model has no rotary module, :func:`reencode_support` says why and
callers prefill cold instead.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

# rope types whose angle is inv_freq * position with a fixed inv_freq (yarn only rescales)
LINEAR_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})


def decoder(model: Any) -> Any:
    """The decoder stack of a causal LM (``model.model``, or its text model)."""
    inner = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    return getattr(inner, "language_model", inner)


def _rope_types(config: Any) -> list[str]:
    params = getattr(config, "rope_parameters", None) or {}
    if params and all(isinstance(v, dict) for v in params.values()):  # per layer type (Gemma3)
        return [str(v.get("rope_type", "default")) for v in params.values()]
    return [str(params.get("rope_type", "default"))]


def reencode_support(model: Any) -> str | None:
    """None when cached keys of ``model`` can be moved exactly, else the reason they cannot."""
    config = getattr(model.config, "get_text_config", lambda: model.config)()
    rotary = getattr(decoder(model), "rotary_emb", None)
    if rotary is None:
        return f"{type(model).__name__} has no rotary embedding to re-encode positions with"
    if float(getattr(config, "partial_rotary_factor", 1.0) or 1.0) != 1.0:
        return "partial rotary embeddings are not re-encoded"
    unsupported = sorted(set(_rope_types(config)) - LINEAR_ROPE_TYPES)
    if unsupported:
        return f"rope type {unsupported[0]!r} is not linear in the position"
    return None


def layer_rope_key(model: Any, layer: int) -> str | None:
    """The argument that picks layer ``layer``'s rotary table (Gemma3: its layer type)."""
    rotary = decoder(model).rotary_emb
    if "layer_type" not in inspect.signature(rotary.forward).parameters:
        return None
    config = getattr(model.config, "get_text_config", lambda: model.config)()
    return str(config.layer_types[layer])


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@torch.inference_mode()
def rotation(
    model: Any, delta: int, like: torch.Tensor, layer_type: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[D]`` (float32) of a rotation by ``delta`` positions, unscaled."""
    rotary = decoder(model).rotary_emb
    x = like.new_zeros(1, 1, like.shape[-1], dtype=torch.float32)
    positions = torch.tensor([[delta]], device=like.device)
    args = (x, positions) if layer_type is None else (x, positions, layer_type)
    cos, sin = rotary(*args)
    # yarn scales cos/sin by an attention factor that the cached keys already carry
    name = "attention_scaling" if layer_type is None else f"{layer_type}_attention_scaling"
    scale = float(getattr(rotary, name, 1.0) or 1.0)
    return cos[0, 0].float() / scale, sin[0, 0].float() / scale


@torch.inference_mode()
def shift_keys(
    model: Any, keys: torch.Tensor, delta: int, layer_type: str | None = None
) -> torch.Tensor:
    """``keys`` (``[B, Hkv, n, D]``, RoPE applied) as they would be ``delta`` positions later.

    k' = k cos(d) + rotate_half(k) sin(d): the rotation by ``d`` composed onto each key's own.
    """
    if delta == 0:
        return keys
    cos, sin = rotation(model, delta, keys, layer_type)
    k = keys.float()
    return (k * cos + _rotate_half(k) * sin).to(keys.dtype)


def shift_layers(
    model: Any, layers: list[tuple[torch.Tensor, torch.Tensor]], delta: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's ``(keys, values)`` moved by ``delta`` positions (values carry no position)."""
    return [
        (shift_keys(model, k, delta, layer_rope_key(model, i)), v)
        for i, (k, v) in enumerate(layers)
    ]
