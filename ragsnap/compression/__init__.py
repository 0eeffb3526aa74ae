"""KV-cache compression methods ("presses") and the hooks that apply them during prefill."""

from __future__ import annotations

from typing import Any

from ragsnap.compression.base import CompressedLayer, LayerContext, Press, ScorerPress
from ragsnap.compression.full import FullPress
from ragsnap.compression.h2o import H2OPress
from ragsnap.compression.hooks import compression_hooks
from ragsnap.compression.pyramidkv import PyramidKVPress
from ragsnap.compression.random_press import RandomPress
from ragsnap.compression.snapkv import SnapKVPress
from ragsnap.compression.streamingllm import StreamingLLMPress
from ragsnap.errors import ConfigError

PRESSES: dict[str, type[Press]] = {
    cls.name: cls
    for cls in (FullPress, SnapKVPress, StreamingLLMPress, H2OPress, RandomPress, PyramidKVPress)
}
DEFAULT_PRESS = "snapkv"


def make_press(name: str = DEFAULT_PRESS, **options: Any) -> Press:
    """Build a press by name; options that are None are left at the press's default.

    Raises :class:`ConfigError` for an unknown press or an option the press does not take.
    """
    cls = PRESSES.get(name)
    if cls is None:
        raise ConfigError(
            f"unknown press {name!r} (choose from: {', '.join(PRESSES)})", field="press"
        )
    given = {k: v for k, v in options.items() if v is not None}
    if cls is FullPress:
        return FullPress()
    if "ratio" in given and "budget" not in given:
        given["budget"] = None
    fields = getattr(cls, "__dataclass_fields__", {})
    unknown = sorted(set(given) - set(fields))
    if unknown:
        raise ConfigError(f"press {name!r} does not take: {', '.join(unknown)}", field=unknown[0])
    return cls(**given)


__all__ = [
    "PRESSES",
    "DEFAULT_PRESS",
    "CompressedLayer",
    "LayerContext",
    "Press",
    "ScorerPress",
    "compression_hooks",
    "make_press",
]
