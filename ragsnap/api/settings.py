"""Service settings: the engine configuration plus the server's own, from environment
variables with the ``RAGSNAP_`` prefix (or keyword arguments)."""

from __future__ import annotations

import hashlib
from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import NoDecode

from ragsnap.engine.config import DEFAULT_MAX_BATCH, DEFAULT_STEP_TOKENS, EngineConfig


class Settings(EngineConfig):
    """Everything the service can be told: the engine's configuration and what only a
    server has. Every limit has a default that fits the embedded model; ``api_keys`` is
    empty by default (no authentication)."""

    # where to listen and what to serve
    host: str = Field(default="127.0.0.1", description="address to listen on")
    port: int = Field(default=8000, ge=1, le=65535, description="port to listen on")
    cache_ping_interval_s: float = Field(
        default=1.5, ge=0, le=60, description="/readyz asks the store at most this often"
    )
    reserve_prefix_tokens: int = Field(
        default=4096,
        ge=0,
        le=1 << 20,
        description="batch memory reserved at start for new questions over cached documents: "
        "max_batch prompts of this many tokens (fresh memory is slow to touch on first use); "
        "0 = allocate on first use",
    )
    corpus_dir: str | None = Field(default=None, description="folder searched by the `query` field")
    served_model_name: str = Field(
        default="ragsnap", description="alias accepted as `model` on /v1"
    )
    playground: bool = Field(
        default=True, description="serve the web playground at / (its API calls need a key)"
    )

    # authentication: comma-separated keys; each key gets its own cache namespace
    api_keys: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list,
        description="comma-separated keys: with keys, /v1/* needs `Authorization: Bearer "
        "<key>` (401 otherwise) and each key gets its own cache namespace",
    )

    # who may see the API description: auto = public without keys, hidden with keys;
    # auth = /openapi.json and /docs need a key too; off = never served
    docs: Literal["auto", "public", "auth", "off"] = Field(
        default="auto",
        description="/docs and /openapi.json: auto (public without keys, off with keys), "
        "public, auth (need a key) or off",
    )
    # Host header values accepted (DNS rebinding guard); "*" accepts any. Ports are ignored.
    # Unset: any Host when API keys are set; without keys, only the names of the address
    # the server binds to (localhost names, the bind address; the machine's names on 0.0.0.0)
    allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="comma-separated Host values accepted (`*` for any; others get 400). "
        "Unset: any with API keys, else only the bind address's names (stops DNS rebinding)",
    )
    metrics_key: SecretStr | None = Field(
        default=None,
        description="with API keys set, /metrics needs an API key or this key (a scraper's "
        "bearer token that opens nothing else)",
    )

    # request limits
    max_documents: int = Field(default=32, ge=1, description="documents per request (413)")
    max_document_bytes: int = Field(
        default=64_000, ge=1, description="UTF-8 bytes of one document's title and text (413)"
    )
    max_total_bytes: int = Field(
        default=512_000, ge=1, description="bytes of all documents together (413)"
    )
    max_question_chars: int = Field(default=2_000, ge=1, description="question length (413)")
    max_document_tokens: int = Field(default=16_384, ge=1, description="tokens of one document")
    max_question_tokens: int = Field(default=1_024, ge=1, description="tokens of the question")
    max_prompt_tokens: int = Field(
        default=32_768, ge=1, description="tokens of all documents and the question together"
    )
    max_new_tokens_limit: int = Field(
        default=512, ge=1, description="the largest max_new_tokens a request may ask (422/400)"
    )
    max_body_bytes: int = Field(
        default=1_048_576, ge=1024, description="request body size, checked before parsing (413)"
    )
    body_timeout_s: float = Field(
        default=30.0, gt=0, le=3600, description="a request body must arrive within this (408)"
    )
    kv_memory_gib: float | None = Field(
        default=None,
        gt=0,
        le=1 << 20,
        allow_inf_nan=False,
        description="GiB of KV memory this process holds: the running requests' (compressed "
        "caches with room for their new tokens, a prefilling prompt's full KV) and its "
        "in-memory cache tiers' (cut to a quarter of it at most); requests that do not fit "
        "wait, one larger than the requests' part is refused (413). Unset: admission by "
        "max_batch only",
    )
    header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        le=3600,
        description="a request's line and headers must arrive within this of their first byte "
        "(or of the connection): else 408 and the connection closes",
    )
    idle_timeout_s: int = Field(
        default=5, ge=1, le=3600, description="an idle keep-alive connection closes after this"
    )
    max_connections: int = Field(
        default=1024,
        ge=1,
        le=1_000_000,
        description="open connections per server; one more is answered 503 and closed at once",
    )
    # per API key (per client address without keys); 0 = no limit
    rate_limit_per_minute: int = Field(
        default=0,
        ge=0,
        description="requests per API key (per client address without keys); over it 429; 0: off",
    )
    rate_limit_burst: int | None = Field(
        default=None, ge=1, description="requests allowed at once (default: the per-minute rate)"
    )
    max_top_k: int = Field(default=20, ge=1, description="most passages a `query` may take")
    default_top_k: int = Field(default=4, ge=1, description="passages a `query` takes by default")

    # the worker queue
    max_queue: int = Field(default=8, ge=1, description="requests allowed to wait for the worker")
    retry_after_s: int = Field(default=2, ge=1, description="smallest Retry-After sent with a 429")
    max_batch: int = Field(
        default=DEFAULT_MAX_BATCH,
        ge=1,
        le=256,
        description="requests decoded together (1: one at a time)",
    )
    # 512: cold 2K-token requests at 4 concurrent (embedded model, 2-core AVX2 CPU, prefill on
    # both cores) came 1.46x as fast as with 128 and their median first token 1.9x as soon
    # (bench peer); streams next to a prefill get their tokens in bursts (one per chunk).
    # 128 keeps streams smooth: their p95 token gap widened 3.3x, against 7.1x at 256
    # (bench batch --gap-chunks). Where chunks ride the decode pass (lean Llama pass, CPU),
    # 256 prefilled 2.3K tokens beside 8 rows in 2.38 s against 2.33 s at 512, with half
    # the token gaps (241 against 484 ms p50; one thread, shared 2-core AMX Xeon)
    step_tokens: int = Field(
        default=DEFAULT_STEP_TOKENS,
        ge=32,
        le=65536,
        description="token budget of one scheduler step: a prefill chunk plus one token per running request",
    )

    prefill_threads: int | None = Field(
        default=None,
        ge=1,
        le=1024,
        description="torch threads while a prompt prefills (compute-bound). Unset: every core "
        "the server may run on",
    )
    decode_threads: int | None = Field(
        default=None,
        ge=1,
        le=1024,
        description="torch threads of a decode step (all running requests' next tokens). "
        "Unset: the server's --threads",
    )

    @field_validator("api_keys", "allowed_hosts", mode="before")
    @classmethod
    def _split_keys(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @property
    def kv_memory_bytes(self) -> int | None:
        return None if self.kv_memory_gib is None else int(self.kv_memory_gib * 2**30)

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_keys)

    @property
    def docs_mode(self) -> str:
        """``public``, ``auth`` or ``off`` (``auto`` resolved by whether keys are set)."""
        if self.docs == "auto":
            return "off" if self.auth_enabled else "public"
        return self.docs

    def key_digests(self) -> dict[str, str]:
        """sha256 of each API key -> the namespace its requests use (never the key itself)."""
        out = {}
        for key in self.api_keys:
            digest = hashlib.sha256(key.get_secret_value().encode("utf-8")).hexdigest()
            out[digest] = f"key-{digest[:16]}"
        return out
