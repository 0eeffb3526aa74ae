"""A model and its runtime as the configuration says: what the engine builds on, and what
measurement tools (``ragsnap eval``, ``calibrate``, ``diagnose``, ``bench``) drive
directly, with the same threads, dtype and drafting."""

from __future__ import annotations

from typing import Any

import torch

from ragsnap.cache.backends.store import KVStore
from ragsnap.cache.serialization import parse_dtype
from ragsnap.cache.tiers.cached_prefill import CachedPrefill
from ragsnap.engine.config import EngineConfig
from ragsnap.runtime.loading.models import LoadedModel, load_model
from ragsnap.runtime.model_runtime import ModelRuntime
from ragsnap.runtime.threads import configure_threads


def configured_model(config: EngineConfig, **load_options: Any) -> LoadedModel:
    """Set the config's threads, then load its model (``load_options``: see
    :func:`load_model`, e.g. ``attn_implementation``, ``revision``)."""
    configure_threads(config.threads)
    return load_model(
        config.model,
        device=config.device,
        dtype=config.dtype,
        matmul_precision=config.matmul_precision,
        four_bit_weights=config.four_bit_weights,
        **load_options,
    )


def runtime_for(
    loaded: LoadedModel, config: EngineConfig, chunk: int | None = None
) -> ModelRuntime:
    """The runtime of ``loaded`` with the config's drafting (``chunk``: prefill chunk)."""
    return ModelRuntime(
        loaded,
        chunk=chunk,
        speculate=config.speculate,
        ngrams=config.speculate_ngrams,
        commit_drafts=config.commit_lookahead,
    )


def load_runtime(config: EngineConfig, **load_options: Any) -> ModelRuntime:
    """A runtime on the config's model, without an engine: no cache tiers, no citations."""
    return runtime_for(configured_model(config, **load_options), config)


def plain_runtime(**fields: Any) -> ModelRuntime:
    """A runtime that decodes plainly (no drafted or committed tokens), as benchmarks of the
    runtime measure it: ``fields`` are :class:`EngineConfig` fields (None: not given)."""
    from ragsnap.engine.config import configured

    given = {name: value for name, value in fields.items() if value is not None}
    plain = {"speculate": 0, "speculate_ngrams": False, "commit_lookahead": False}
    return load_runtime(configured(EngineConfig, **{**given, **plain}))


def tiers_for(
    runtime: ModelRuntime, store: KVStore | None, config: EngineConfig
) -> CachedPrefill | None:
    """The cache tiers ``config`` asks for on ``store`` (None: no store, or a disabled one)."""
    if store is None or not store.enabled:
        return None

    def dtype(name: str) -> torch.dtype | None:
        return None if name == "auto" else parse_dtype(name)

    return CachedPrefill(
        runtime.loaded,
        store,
        runtime.cache_from,
        prefix_cache=config.prefix_cache,
        prefix_store=config.prefix_store,
        storage_dtype=dtype(config.storage_dtype),
        prefix_dtype=dtype(config.prefix_storage_dtype),
        document_cache=config.document_cache,
        blend_reason=runtime.blend_support(),
        prefix_memory_bytes=config.prefix_memory_mb << 20,
        hit_memory_bytes=config.hit_memory_mb << 20,
    )
