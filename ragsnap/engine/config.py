"""The engine configuration: every engine setting and its default, written once.

Each field is also an environment variable (``RAGSNAP_<NAME>``) and, where it makes sense
on a command line, a flag (:mod:`ragsnap.engine.options` generates them). The CLI, the
server's settings (a subclass adding what only a server has), Ray replicas, LangChain's
in-process model and :meth:`RagSnapEngine.load` all build this one class, so the same
request gets the same answer and statistics through every entrance.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from ragsnap.cache.tiers.cached_prefill import DEFAULT_HIT_MEMORY_BYTES, DEFAULT_PREFIX_MEMORY_BYTES
from ragsnap.citations.options import ABSTAIN_TEXT
from ragsnap.engine.press_settings import PressSettings
from ragsnap.prompt.assembly import DEFAULT_DOCUMENT_ORDER, DocumentOrder
from ragsnap.runtime.blend import DEFAULT_RECOMPUTE_SHARE, DEFAULT_SELECTION
from ragsnap.runtime.drafts import DEFAULT_SPECULATE
from ragsnap.runtime.generation import DEFAULT_MAX_NEW_TOKENS

StorageDtype = Literal["auto", "float32", "bfloat16", "float16", "int8"]

# the scheduler's defaults, read by the server's max_batch and step_tokens settings, the
# worker and the scheduler (the settings say why these values)
DEFAULT_MAX_BATCH = 8
DEFAULT_STEP_TOKENS = 512


class EngineConfig(BaseSettings, PressSettings):
    """How an engine loads, caches and answers; keyword arguments win over ``RAGSNAP_*``.

    The press settings (``default_press``, ``budget``, ``window``...) are
    :class:`~ragsnap.engine.press_settings.PressSettings`'s fields, declared there once."""

    model_config = SettingsConfigDict(env_prefix="RAGSNAP_", extra="forbid")

    # -- the model -----------------------------------------------------------------------
    model: str = Field(
        default="embedded",
        description="'embedded' (SmolLM2-135M-Instruct, bundled), a Hugging Face id, a "
        "directory or a .gguf file",
    )
    device: str = Field(default="auto", description="auto (cuda when available), cpu, cuda:1...")
    dtype: str = Field(
        default="auto",
        description="compute dtype: auto (bfloat16 on CUDA and on CPUs with AMX, else "
        "float32), float32, bfloat16",
    )
    matmul_precision: Literal["auto", "highest", "medium"] = Field(
        default="auto",
        description="float32 CPU models: medium rounds the inputs of long products to "
        "bfloat16 (float32 accumulation); auto: medium on CPUs with AVX512-BF16",
    )
    four_bit_weights: bool = Field(
        default=True,
        description="bfloat16 CPU models whose weights are 4-bit blocks (the embedded GGUF): "
        "products of at most 8 rows (decode steps) read a 4-bit copy of the weights",
    )
    threads: int | None = Field(
        default=None,
        ge=1,
        le=1024,
        description="torch threads (unset: $OMP_NUM_THREADS, else 1 on machines of two cores "
        "or fewer and half the cores on larger ones)",
    )

    # -- the KV cache --------------------------------------------------------------------
    cache_url: str | None = Field(
        default=None,
        description="KV store: redis://..., rediss://..., unix://..., file://DIR or none "
        "(unset: a sealed file store under the user cache directory)",
    )
    cache_key: SecretStr | None = Field(
        default=None,
        description="secret that encrypts and authenticates every cache entry (AES-GCM); "
        "a shared store (Redis) needs it",
    )
    storage_dtype: StorageDtype = Field(
        default="auto",
        description="dtype of stored compressed entries: auto (the model's), a smaller float, "
        "or int8 (one float32 scale per head and token)",
    )
    prefix_storage_dtype: StorageDtype = Field(
        default="int8",
        description="dtype of stored document prefixes, the reuse material of new questions "
        "(each document's piece points into one): int8 (a quarter of float32, one float32 "
        "scale per head and token), a float, or auto (the model's)",
    )
    prefix_cache: bool = Field(
        default=True,
        description="also keep the full KV of a document prefix, so a new question over the "
        "same documents prefills only its own tokens",
    )
    prefix_store: Literal["recurring", "always"] = Field(
        default="recurring",
        description="when a miss's document prefix is written to the store with the "
        "per-document tier off (with it on, always: the pieces point into it): once its "
        "document set recurs (first seen, it is kept in this process's memory only), or "
        "after every miss",
    )
    # on since issue 44's targets held at n = 100 (lab/results.md, "Reuse on by default")
    document_cache: bool = Field(
        default=True,
        description="keep each document's KV and reuse it in new combinations and orders, "
        "a share of its tokens recomputed (approximate: see bench reuse)",
    )
    recompute_share: float = Field(
        default=DEFAULT_RECOMPUTE_SHARE,
        ge=0.0,
        le=1.0,
        description="share of reused document tokens recomputed with the full context "
        "(0: plain concatenation, 1: as a cold prefill)",
    )
    recompute_select: Literal["question", "early-question", "deviation", "both", "leading"] = Field(
        default=DEFAULT_SELECTION,
        description="which reused tokens are recomputed: those the question attends to "
        "(over every layer, or the first 8: early-question), CacheBlend's layer-1 KV "
        "deviation, both, or each piece's first tokens (leading: no ranking pass)",
    )
    prefix_memory_mb: int = Field(
        default=DEFAULT_PREFIX_MEMORY_BYTES >> 20,
        ge=0,
        description="MiB of document prefixes kept in this process's memory in front of the "
        "store; 0 = off",
    )
    hit_memory_mb: int = Field(
        default=DEFAULT_HIT_MEMORY_BYTES >> 20,
        ge=0,
        description="MiB of compressed entries kept loaded in this process's memory once read "
        "or written; 0 = off",
    )

    # -- decoding ------------------------------------------------------------------------
    speculate: int = Field(
        default=DEFAULT_SPECULATE,
        ge=0,
        le=16,
        description="drafted tokens a greedy answer feeds per decode step, checked in the "
        "same pass (0: off; the answer is the same)",
    )
    speculate_ngrams: bool = Field(
        default=True,
        description="also draft what followed the answer's last tokens in the prompt or the "
        "answer (prompt lookup)",
    )
    commit_lookahead: bool = Field(
        default=True,
        description="greedy answers start with the tokens the lookahead press drafted on the "
        "full cache, fed once and kept unchecked (false: every token is decoded on the "
        "compressed cache)",
    )

    # -- what a request that says nothing gets -------------------------------------------
    default_max_new_tokens: int = Field(
        default=DEFAULT_MAX_NEW_TOKENS, ge=1, le=1 << 20, description="longest answer, in tokens"
    )
    document_order: DocumentOrder = Field(
        default=DEFAULT_DOCUMENT_ORDER,
        description="relevance: by BM25 relevance to the question, the most relevant last; "
        "given: as listed (the same document prefix for every question); stable: by "
        "relevance the first time a document set is seen, then as that first time (its "
        "prefix entry serves later questions)",
    )
    unsupported: Literal["flag", "abstain"] = Field(
        default="flag",
        description="flag an answer its quotes do not back (`grounded: false`), or abstain "
        "(the answer becomes abstain_text)",
    )
    abstain_text: str = Field(
        default=ABSTAIN_TEXT,
        min_length=1,
        max_length=1_000,
        description="the answer that replaces one not grounded, with unsupported=abstain",
    )

    @property
    def cache_secret(self) -> str:
        """The sealing key's text ("" when none is set)."""
        return self.cache_key.get_secret_value() if self.cache_key is not None else ""


Config = TypeVar("Config", bound=BaseSettings)


def configured(cls: type[Config], **given: Any) -> Config:
    """``cls`` (:class:`EngineConfig` or a subclass) from ``given`` and the environment; a
    bad value is one :class:`~ragsnap.errors.ConfigError` naming the setting."""
    from pydantic import ValidationError

    from ragsnap.errors import ConfigError

    try:
        return cls(**given)
    except ValidationError as exc:
        first = exc.errors()[0]
        name = ".".join(str(part) for part in first["loc"])
        raise ConfigError(f"setting {name}: {first['msg']}", field=name) from None
