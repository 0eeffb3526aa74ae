"""Per-layer budgets from a measured layer sensitivity: the same total cache, spent where it matters.

A uniform budget assumes every layer suffers equally from eviction. Measured on the
embedded model, they do not: compressing layers 0-5 alone to 128 tokens barely moves the
answer distribution, while layers 12-29 carry almost all of SnapKV's error. A
:class:`LayerProfile` records, per layer, ``s_l`` = the mean KL(full || only layer ``l``
compressed) over calibration items (``ragsnap calibrate``, held-out items). With SnapKV's
error falling roughly as ``1 / budget`` (it halves per doubling on HotpotQA and BioASQ),
minimizing ``sum_l s_l / c_l`` at a fixed total ``sum_l c_l`` gives ``c_l ~ sqrt(s_l)``:
the non-window budget of layer ``l`` is its share of the uniform total.

Profiles for known models ship in ``ragsnap/compression/profiles/`` and are found by a
fingerprint of the model's config; a model without one gets uniform budgets.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from ragsnap.compression.base import LayerContext
from ragsnap.compression.snapkv import SnapKVPress
from ragsnap.errors import ConfigError, InputError

PROFILE_VERSION = 1
MIN_SHARE = 0.1  # raw shares are floored here (then renormalized): no layer is left bare


def model_fingerprint(config: Any) -> str:
    """A file-name-safe id of a model's architecture and size (what a profile is valid for)."""
    text = getattr(config, "text_config", None) or config
    parts = (
        getattr(text, "model_type", "model"),
        f"L{text.num_hidden_layers}",
        f"d{text.hidden_size}",
        f"h{text.num_attention_heads}",
        f"kv{getattr(text, 'num_key_value_heads', text.num_attention_heads)}",
        f"v{text.vocab_size}",
    )
    return "-".join(str(p) for p in parts)


@dataclass(frozen=True)
class LayerProfile:
    """Measured per-layer sensitivity of one model (see the module docstring)."""

    model: str  # model_fingerprint of the model it was measured on
    sensitivity: tuple[float, ...]  # [num_layers] mean KL with only that layer compressed
    budget: int  # the per-layer budget the sensitivity was measured at
    items: tuple[str, ...] = ()  # calibration item ids
    source: str = ""  # how it was measured (command, data)

    def shares(self) -> tuple[float, ...]:
        """Each layer's share of the uniform non-window budget: ``[num_layers]``, mean 1.

        ``sqrt(s_l)`` normalized, with a floor of :data:`MIN_SHARE`.
        """
        roots = [math.sqrt(max(s, 0.0)) for s in self.sensitivity]
        total = sum(roots)
        if total <= 0:
            return tuple(1.0 for _ in roots)
        raw = [len(roots) * r / total for r in roots]
        floored = [max(MIN_SHARE, r) for r in raw]
        mean = sum(floored) / len(floored)
        return tuple(f / mean for f in floored)

    def to_json(self) -> str:
        return json.dumps({"version": PROFILE_VERSION, **asdict(self)}, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, origin: str = "profile") -> LayerProfile:
        try:
            data = json.loads(text)
            if data.get("version") != PROFILE_VERSION:
                raise ValueError(f"version {data.get('version')!r}, expected {PROFILE_VERSION}")
            sensitivity = tuple(float(s) for s in data["sensitivity"])
            if not sensitivity or any(not math.isfinite(s) or s < 0 for s in sensitivity):
                raise ValueError("sensitivity must be non-negative finite numbers")
            return cls(
                model=str(data["model"]),
                sensitivity=sensitivity,
                budget=int(data["budget"]),
                items=tuple(str(i) for i in data.get("items", ())),
                source=str(data.get("source", "")),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise InputError(f"{origin} is not a layer profile: {exc}", field="profile") from exc

    @classmethod
    def load(cls, path: str | Path) -> LayerProfile:
        path = Path(path)
        if not path.is_file():
            raise InputError(f"layer profile not found: {path}", field="profile")
        return _load_profile(str(path), path.stat().st_mtime_ns)


@cache
def _load_profile(path: str, mtime_ns: int) -> LayerProfile:
    """Parse a profile file once per version of it (presses read it for every layer)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = "not UTF-8 text" if isinstance(exc, UnicodeDecodeError) else exc.strerror
        raise InputError(f"cannot read layer profile {path}: {reason}", field="profile") from None
    return LayerProfile.from_json(text, origin=path)


def _profiles_dir() -> Any:
    return resources.files("ragsnap.compression").joinpath("profiles")


@cache
def packaged_profile(fingerprint: str) -> LayerProfile | None:
    """The profile shipped for ``fingerprint``, or None."""
    entry = _profiles_dir().joinpath(f"{fingerprint}.json")
    if not entry.is_file():
        return None
    return LayerProfile.from_json(entry.read_text(), origin=f"packaged profile {fingerprint}")


@cache
def _packaged_digest() -> str:
    files = sorted(
        (entry.name, entry.read_bytes())
        for entry in _profiles_dir().iterdir()
        if entry.name.endswith(".json")
    )
    return hashlib.sha256(repr(files).encode()).hexdigest()[:16]


def profile_digest(profile: str) -> str | None:
    """A digest of the profile(s) ``profile`` may resolve to: part of the press config, so
    cached entries made under another profile are not reused."""
    if profile == "uniform":
        return None
    if profile == "auto":
        return _packaged_digest()
    return hashlib.sha256(Path(profile).read_bytes()).hexdigest()[:16]


def split_budget(free: int, shares: Sequence[float], cap: int | None = None) -> list[int]:
    """Split ``free * len(shares)`` tokens over layers in proportion to ``shares`` (positive).

    A layer whose part would exceed ``cap`` (what its prompt holds) gets ``cap`` and the rest
    is split again over the others, so the total stays the uniform total (or ``cap`` per
    layer when even that is more). Largest-remainder rounding keeps the total exact.
    """
    count = len(shares)
    total = free * count if cap is None else min(free, cap) * count
    capped: dict[int, int] = {}
    while True:
        open_layers = [i for i in range(count) if i not in capped]
        remaining = total - sum(capped.values())
        weight = sum(shares[i] for i in open_layers)
        exact = {i: remaining * shares[i] / weight for i in open_layers}
        over = [i for i in open_layers if cap is not None and exact[i] > cap]
        if not over:
            break
        capped.update((i, cap) for i in over if cap is not None)
    parts = {i: math.floor(x) for i, x in exact.items()}
    order = sorted(open_layers, key=lambda i: exact[i] - parts[i], reverse=True)
    for i in order[: remaining - sum(parts.values())]:
        parts[i] += 1
    return [capped[i] if i in capped else parts[i] for i in range(count)]


@dataclass
class LayerBudgetSnapKVPress(SnapKVPress):
    """SnapKV whose per-layer budgets follow a sensitivity profile (same total as uniform).

    ``profile`` is ``"auto"`` (the packaged profile for the model, uniform when there is
    none), ``"uniform"``, or the path of a profile JSON written by ``ragsnap calibrate``.
    """

    name = "layerbudget"
    profile: str = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.profile not in ("auto", "uniform"):
            LayerProfile.load(self.profile)  # a bad path fails when the press is built

    def config(self) -> dict[str, Any]:
        return {**super().config(), "profile_digest": profile_digest(self.profile)}

    def layer_shares(self, layer: LayerContext) -> tuple[float, ...] | None:
        """``[num_layers]`` budget shares for ``layer``'s model, or None for uniform budgets."""
        if self.profile == "uniform":
            return None
        fingerprint = model_fingerprint(layer.module.config)
        if self.profile == "auto":
            found = packaged_profile(fingerprint)
            if found is None:
                return None
            profile = found
        else:
            profile = LayerProfile.load(self.profile)
            if profile.model != fingerprint:
                raise ConfigError(
                    f"layer profile {self.profile} was measured on {profile.model}, "
                    f"not this model ({fingerprint})",
                    field="profile",
                )
        if len(profile.sensitivity) != layer.num_layers:
            raise ConfigError(
                f"layer profile has {len(profile.sensitivity)} layers, the model "
                f"{layer.num_layers}",
                field="profile",
            )
        return profile.shares()

    def layer_budget(self, layer: LayerContext) -> int:
        uniform = super().layer_budget(layer)
        shares = self.layer_shares(layer)
        if shares is None or uniform <= self.window:
            return uniform
        free = split_budget(uniform - self.window, shares, cap=layer.seq_len - self.window)
        return self.window + free[layer.layer_idx]
