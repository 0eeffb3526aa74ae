"""ragsnap: RAG middleware with query-aware KV-cache compression for long-prompt QA.

The names of the basic snippet import from the top level::

    from ragsnap import AnswerOptions, Document, RagSnapEngine, make_press

They are resolved on first use (module ``__getattr__``), so ``import ragsnap`` loads
neither torch nor transformers.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from ragsnap.citations import Citation
    from ragsnap.compression import make_press
    from ragsnap.engine.engine import AnswerOptions, RagSnapEngine
    from ragsnap.engine.events import CitationsEvent, DoneEvent, MetaEvent, TokenEvent
    from ragsnap.errors import RagSnapError
    from ragsnap.prompt.documents import Document, load_documents
    from ragsnap.runtime.generation import GenerationConfig

_EXPORTS = {
    "AnswerOptions": "ragsnap.engine.engine",
    "Citation": "ragsnap.citations",
    "CitationsEvent": "ragsnap.engine.events",
    "Document": "ragsnap.prompt.documents",
    "DoneEvent": "ragsnap.engine.events",
    "GenerationConfig": "ragsnap.runtime.generation",
    "MetaEvent": "ragsnap.engine.events",
    "RagSnapEngine": "ragsnap.engine.engine",
    "RagSnapError": "ragsnap.errors",
    "TokenEvent": "ragsnap.engine.events",
    "load_documents": "ragsnap.prompt.documents",
    "make_press": "ragsnap.compression",
}

__all__ = [
    "AnswerOptions",
    "Citation",
    "CitationsEvent",
    "Document",
    "DoneEvent",
    "GenerationConfig",
    "MetaEvent",
    "RagSnapEngine",
    "RagSnapError",
    "TokenEvent",
    "__version__",
    "load_documents",
    "make_press",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ragsnap' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
