"""Cache entries as safetensors payloads (no pickle), and back.

A compressed entry holds, per cache layer ``i``, ``k.i``/``v.i`` (``[1, Hkv, n_i, D]``);
per compressed layer ``j`` (``kept_layers[j]`` names its cache layer) the kept positions
``idx.j`` (``[1, Hkv, n]``, int16/int32 on disk) and, when the press made them, ``bias.j``
and ``exact.j``; and ``logits`` (``[1, V]``), the prompt's last logits, so a hit needs no
forward pass before its first token. A prefix entry holds ``k.i``/``v.i`` of the document
prefix only. The safetensors metadata carries the format version, model, lengths, press
config and dtypes; an entry of another format version is :class:`StaleEntry`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ragsnap.cache import int8_kv
from ragsnap.compression.kept import CompressedLayer

FORMAT_VERSION = "1"
KIND_COMPRESSED = "kv"
KIND_PREFIX = "prefix"
KIND_DOCUMENT = (
    "doc"  # one document body's full KV (the per-document tier), same layout as a prefix
)
_HEADER_LIMIT = 100 * 2**20  # safetensors' own cap on the JSON header


class StaleEntry(ValueError):
    """A payload that is not a usable entry: another format version, model or kind."""


def parse_dtype(name: str | None) -> torch.dtype | None:
    """``"bfloat16"`` -> ``torch.bfloat16``; None or ``"auto"`` -> None (the model's dtype);
    ``"int8"`` (storage only: :mod:`ragsnap.cache.int8_kv`)."""
    if name is None or name in {"", "auto", "model"}:
        return None
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not (dtype.is_floating_point or dtype == torch.int8):
        raise ValueError(f"not a floating-point torch dtype or int8: {name!r}")
    return dtype


def _put_kv(
    tensors: dict[str, torch.Tensor], name: str, x: torch.Tensor, storage: torch.dtype | None
) -> None:
    """Store keys or values ``x`` under ``name`` in ``storage`` (int8: with ``name.scale``)."""
    if storage == torch.int8:
        q, scale = int8_kv.quantize(x)
        tensors[name], tensors[f"{name}.scale"] = _plain(q), _plain(scale)
    else:
        tensors[name] = _plain(x, storage)


def _get_kv(
    tensors: dict[str, torch.Tensor], name: str, device: torch.device | str, dtype: torch.dtype
) -> torch.Tensor:
    """Keys or values stored by :func:`_put_kv`, as ``dtype`` on ``device``."""
    scale = tensors.get(f"{name}.scale")
    if scale is None:
        return tensors[name].to(device, dtype)
    return int8_kv.dequantize(tensors[name], scale, dtype, device)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _plain(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A contiguous CPU tensor owning its memory (safetensors refuses shared storage)."""
    out = tensor.detach().to("cpu", dtype=dtype or tensor.dtype)
    if not out.is_contiguous() or out.untyped_storage().nbytes() != out.nbytes:
        out = out.contiguous().clone()
    return out


def _positions_dtype(length: int) -> torch.dtype:
    return torch.int16 if length <= torch.iinfo(torch.int16).max else torch.int32


def read_metadata(payload: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors payload, without touching its tensors."""
    if len(payload) < 8:
        raise StaleEntry("payload too short for safetensors")
    size = int.from_bytes(payload[:8], "little")
    if size > min(_HEADER_LIMIT, len(payload) - 8):
        raise StaleEntry("bad safetensors header size")
    try:
        header = json.loads(bytes(payload[8 : 8 + size]))
    except ValueError as exc:
        raise StaleEntry("unreadable safetensors header") from exc
    return dict(header.get("__metadata__") or {})


def _check(meta: dict[str, str], kind: str, model_id: str, revision: str) -> None:
    if meta.get("format_version") != FORMAT_VERSION:
        raise StaleEntry(
            f"format version {meta.get('format_version')!r}, expected {FORMAT_VERSION!r}"
        )
    if meta.get("kind") != kind:
        raise StaleEntry(f"entry kind {meta.get('kind')!r}, expected {kind!r}")
    if meta.get("model_id") != model_id or meta.get("revision") != revision:
        raise StaleEntry("entry belongs to another model")


def _model_dtype(meta: dict[str, str], expected: torch.dtype | None) -> torch.dtype:
    """The entry's compute dtype; StaleEntry when it is not a float dtype or not ``expected``."""
    try:
        dtype = parse_dtype(meta.get("dtype"))
    except ValueError as exc:
        raise StaleEntry(str(exc)) from exc
    if dtype is None or (expected is not None and dtype != expected):
        raise StaleEntry(f"entry dtype {meta.get('dtype')!r} is not the model's ({expected})")
    return dtype


def _check_layers(
    tensors: dict[str, torch.Tensor], meta: dict[str, str], length: int | None = None
) -> int:
    """Check every ``k.i``/``v.i`` pair: stored in ``storage_dtype``, ``[1, Hkv, n, D]``
    with one ``Hkv`` and ``D`` for all layers (``n == length`` when given). Returns the
    layer count. Raises StaleEntry."""
    try:
        storage = parse_dtype(meta.get("storage_dtype"))
        count = int(meta["num_layers"])
    except (KeyError, ValueError) as exc:
        raise StaleEntry(f"bad layer metadata: {exc}") from exc
    if not 0 < count <= 4096:
        raise StaleEntry(f"implausible layer count {count}")
    shape: tuple[int, int] | None = None
    for i in range(count):
        k, v = tensors.get(f"k.{i}"), tensors.get(f"v.{i}")
        if k is None or v is None:
            raise StaleEntry(f"layer {i} is missing")
        if k.dtype != storage or v.dtype != storage:
            raise StaleEntry(f"layer {i} is {k.dtype}/{v.dtype}, the entry says {storage}")
        if storage == torch.int8:
            _check_scales(tensors, f"k.{i}", k)
            _check_scales(tensors, f"v.{i}", v)
        if k.dim() != 4 or k.shape[0] != 1 or k.shape[:3] != v.shape[:3]:
            raise StaleEntry(f"layer {i} has shapes {tuple(k.shape)} / {tuple(v.shape)}")
        if length is not None and k.shape[2] != length:
            raise StaleEntry(f"layer {i} holds {k.shape[2]} positions, expected {length}")
        heads = (int(k.shape[1]), int(k.shape[3]))
        if shape is not None and heads != shape:
            raise StaleEntry(f"layer {i} has {heads} heads/dims, layer 0 has {shape}")
        shape = heads
    return count


def _check_scales(tensors: dict[str, torch.Tensor], name: str, q: torch.Tensor) -> None:
    """An int8 tensor's scales: float, one per vector ``q.shape[:-1] + (1,)``, finite."""
    scale = tensors.get(f"{name}.scale")
    if (
        scale is None
        or not scale.is_floating_point()
        or tuple(scale.shape) != (*q.shape[:-1], 1)
        or not bool(torch.isfinite(scale).all())
    ):
        raise StaleEntry(f"{name}: missing or malformed int8 scales")


def _check_kept(layer: CompressedLayer, original_length: int, j: int) -> None:
    """Kept positions ``[1, Hkv, n]`` inside the prompt, one per kept key; bias ``[1, Hkv, n]``."""
    idx, keys = layer.indices, layer.keys
    if idx.dim() != 3 or tuple(idx.shape) != tuple(keys.shape[:3]):
        raise StaleEntry(
            f"kept layer {j}: positions {tuple(idx.shape)} for keys {tuple(keys.shape)}"
        )
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= original_length):
        raise StaleEntry(f"kept layer {j}: a position outside the prompt")
    if layer.bias is not None and (
        not layer.bias.is_floating_point() or tuple(layer.bias.shape) != tuple(idx.shape)
    ):
        raise StaleEntry(f"kept layer {j}: bias of shape {tuple(layer.bias.shape)}")


def _load_tensors(payload: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    try:
        return load(payload)
    except Exception as exc:  # safetensors raises its own error types
        raise StaleEntry(f"unreadable tensors: {exc}") from exc


@dataclass
class StoredPrefill:
    """A compressed prompt cache as loaded: enough to rebuild a ``PrefillResult``.

    ``layers[i]`` is ``(keys, values)`` of cache layer ``i``, ``[1, Hkv, n_i, D]``;
    ``kept[j]`` belongs to cache layer ``kept_layers[j]`` and shares its tensors.
    """

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    kept: list[CompressedLayer]
    kept_layers: list[int]
    next_logits: torch.Tensor  # [1, V]
    original_length: int
    press_config: dict[str, Any]
    kv_bytes_full: int
    decode_bias: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [1, Hkv, n]
    draft: list[int] = field(default_factory=list)  # the lookahead's tokens (PrefillResult.draft)


def serialize_prefill(
    layers: list[tuple[torch.Tensor, torch.Tensor]],
    kept: list[CompressedLayer],
    next_logits: torch.Tensor,
    *,
    original_length: int,
    press_config: dict[str, Any],
    kv_bytes_full: int,
    model_id: str,
    revision: str,
    storage_dtype: torch.dtype | None = None,
    decode_bias: Mapping[int, torch.Tensor] | None = None,
    draft: Sequence[int] = (),
) -> bytes:
    """A compressed entry as bytes. ``layers`` are the cache's ``(keys, values)`` per layer
    (``[1, Hkv, n_i, D]``); each ``kept`` layer is matched to the cache layer holding its
    tensors, or stored with its own keys and values when none does."""
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    for i, (k, v) in enumerate(layers):
        _put_kv(tensors, f"k.{i}", k, storage_dtype)
        _put_kv(tensors, f"v.{i}", v, storage_dtype)
    kept_layers: list[int] = []
    positions = _positions_dtype(original_length)
    for j, layer in enumerate(kept):
        match = next((i for i, (k, _) in enumerate(layers) if k is layer.keys), -1)
        kept_layers.append(match)
        if match < 0:
            _put_kv(tensors, f"kk.{j}", layer.keys, storage_dtype)
            _put_kv(tensors, f"kv.{j}", layer.values, storage_dtype)
        tensors[f"idx.{j}"] = _plain(layer.indices, positions)
        if layer.bias is not None:
            tensors[f"bias.{j}"] = _plain(layer.bias)
        exact = getattr(layer, "exact", None)
        if exact is not None:
            tensors[f"exact.{j}"] = _plain(exact)
    tensors["logits"] = _plain(next_logits)
    for i, bias in (decode_bias or {}).items():
        tensors[f"dbias.{i}"] = _plain(bias)
    model_dtype = layers[0][0].dtype if layers else next_logits.dtype
    metadata = {
        "format_version": FORMAT_VERSION,
        "kind": KIND_COMPRESSED,
        "model_id": model_id,
        "revision": revision,
        "original_length": str(original_length),
        "press_config": json.dumps(press_config, sort_keys=True, default=str),
        "kv_bytes_full": str(kv_bytes_full),
        "kept_layers": json.dumps(kept_layers),
        "decode_bias_layers": json.dumps(sorted(int(i) for i in (decode_bias or {}))),
        "draft": json.dumps([int(t) for t in draft]),
        "num_layers": str(len(layers)),
        "dtype": _dtype_name(model_dtype),
        "storage_dtype": _dtype_name(storage_dtype or model_dtype),
    }
    metadata["aliases"] = json.dumps(_share_once(tensors))
    return save(tensors, metadata=metadata)


def _share_once(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """Drop tensors that are the very same view as an earlier one (a decode bias that is the
    kept layer's bias) and return ``{dropped: kept name}``; copy partial overlaps, which
    safetensors refuses to write."""
    seen: dict[int, tuple[str, tuple[Any, ...]]] = {}
    aliases: dict[str, str] = {}
    for name in list(tensors):
        tensor = tensors[name]
        if tensor.nbytes == 0:
            continue
        storage = tensor.untyped_storage().data_ptr()
        view = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())
        if storage in seen and seen[storage][1] == view:
            aliases[name] = seen[storage][0]
            del tensors[name]
        elif storage in seen:
            tensors[name] = tensor.clone()
        else:
            seen[storage] = (name, view)
    return aliases


def deserialize_prefill(
    payload: bytes,
    *,
    model_id: str,
    revision: str,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> StoredPrefill:
    """Rebuild a compressed entry on ``device``, in the dtype it was computed in (which
    must be ``dtype`` when given).

    Raises :class:`StaleEntry` when the payload is of another format version, kind or
    model, or is not self-consistent (dtypes, shapes, kept positions, layer counts).
    """
    meta = read_metadata(payload)
    _check(meta, KIND_COMPRESSED, model_id, revision)
    dtype = _model_dtype(meta, dtype)
    tensors = _load_tensors(payload)
    _check_layers(tensors, meta)
    try:
        aliases = json.loads(meta.get("aliases", "{}"))
        for alias, name in dict(aliases).items():
            if name in tensors:
                tensors[str(alias)] = tensors[name]
        original_length = int(meta["original_length"])
        layers = [
            (_get_kv(tensors, f"k.{i}", device, dtype), _get_kv(tensors, f"v.{i}", device, dtype))
            for i in range(int(meta["num_layers"]))
        ]
        kept = []
        kept_layers = json.loads(meta["kept_layers"])
        for j, i in enumerate(kept_layers):
            if i >= 0:
                keys, values = layers[i]
            else:
                keys, values = (
                    _get_kv(tensors, f"kk.{j}", device, dtype),
                    _get_kv(tensors, f"kv.{j}", device, dtype),
                )
            bias, exact = tensors.get(f"bias.{j}"), tensors.get(f"exact.{j}")
            layer = CompressedLayer(
                indices=tensors[f"idx.{j}"].to(device, torch.long),
                keys=keys,
                values=values,
                bias=None if bias is None else bias.to(device),
            )
            _check_kept(layer, original_length, j)
            if exact is not None:
                layer.exact = exact.to(device)  # type: ignore[attr-defined]
            kept.append(layer)
        logits = tensors["logits"]
        if logits.dim() != 2 or logits.shape[0] != 1 or not logits.is_floating_point():
            raise StaleEntry(f"logits of shape {tuple(logits.shape)}")
        draft = json.loads(meta.get("draft", "[]"))  # entries from before drafts had none
        vocab = logits.shape[1]
        if not isinstance(draft, list) or not all(type(t) is int and 0 <= t < vocab for t in draft):
            raise StaleEntry("drafted tokens outside the vocabulary")
        return StoredPrefill(
            layers=layers,
            kept=kept,
            kept_layers=kept_layers,
            next_logits=logits.to(device),
            original_length=original_length,
            press_config=json.loads(meta["press_config"]),
            kv_bytes_full=int(meta["kv_bytes_full"]),
            decode_bias={
                i: tensors[f"dbias.{i}"].to(device)
                for i in json.loads(meta.get("decode_bias_layers", "[]"))
            },
            draft=draft,
        )
    except (KeyError, ValueError, TypeError, IndexError, AttributeError) as exc:
        raise StaleEntry(f"incomplete entry: {exc}") from exc


def serialize_prefix(
    layers: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    prefix_len: int,
    model_id: str,
    revision: str,
    storage_dtype: torch.dtype | None = None,
    kind: str = KIND_PREFIX,
) -> bytes:
    """The full KV of a document prefix (``[1, Hkv, prefix_len, D]`` per layer) as bytes;
    ``kind`` ``KIND_DOCUMENT`` marks one document's piece instead."""
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    for i, (k, v) in enumerate(layers):
        _put_kv(tensors, f"k.{i}", k, storage_dtype)
        _put_kv(tensors, f"v.{i}", v, storage_dtype)
    model_dtype = layers[0][0].dtype
    metadata = {
        "format_version": FORMAT_VERSION,
        "kind": kind,
        "model_id": model_id,
        "revision": revision,
        "prefix_len": str(prefix_len),
        "num_layers": str(len(layers)),
        "dtype": _dtype_name(model_dtype),
        "storage_dtype": _dtype_name(storage_dtype or model_dtype),
    }
    return save(tensors, metadata=metadata)


def deserialize_prefix(
    payload: bytes,
    *,
    model_id: str,
    revision: str,
    prefix_len: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    kind: str = KIND_PREFIX,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(keys, values)`` per layer, ``[1, Hkv, prefix_len, D]``, on ``device``, in the
    entry's compute dtype (which must be ``dtype`` when given).

    Raises :class:`StaleEntry` for another format version, model or prefix length, or an
    entry that is not self-consistent (dtypes, shapes).
    """
    meta = read_metadata(payload)
    _check(meta, kind, model_id, revision)
    if meta.get("prefix_len") != str(prefix_len):
        raise StaleEntry(f"prefix of {meta.get('prefix_len')} tokens, expected {prefix_len}")
    dtype = _model_dtype(meta, dtype)
    tensors = _load_tensors(payload)
    count = _check_layers(tensors, meta, length=prefix_len)
    return [
        (_get_kv(tensors, f"k.{i}", device, dtype), _get_kv(tensors, f"v.{i}", device, dtype))
        for i in range(count)
    ]
