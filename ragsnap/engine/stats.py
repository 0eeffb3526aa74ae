"""Typed statistics of one answer: what the prompt, the press, the cache and decoding did.

One dataclass, one serializer (:meth:`AnswerStats.to_dict`): the SSE ``done`` event, the
OpenAI route, LangChain's ``response_metadata``, ``ragsnap ask --json`` and the metrics
all read these fields.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class AnswerStats:
    """Statistics of one answer (seconds, tokens per KV head, bytes)."""

    model: str
    device: str
    press: str
    press_config: dict[str, Any]
    budget: int | None
    prompt_tokens: int
    kept_tokens: int  # mean over compressed layers of the entries kept per KV head
    kept_tokens_per_layer: list[int]
    prefill_tokens: int  # tokens this request ran through the model (0 on a cache hit)
    prefill_s: float
    compress_s: float
    ttft_s: float
    decode_ms_per_token: float | None
    new_tokens: int
    decode_s: float
    citations_mode: str  # how citations were found (see ragsnap.citations.CitationOptions)
    attribution_s: float  # seconds spent attributing the answer to documents
    kv_bytes_full: int
    kv_bytes_kept: int
    total_s: float
    cache: str = "off"  # off | miss | hit | prefix-hit | document-hit | unavailable
    cache_bytes_read: int = 0
    cache_bytes_written: int = 0  # entries handed to the store (written after the answer)
    cache_load_s: float = 0.0
    cache_tier: str = "off"  # what served the prefill: exact | prefix | documents | cold | off
    reused_documents: int = 0  # documents whose KV came from the per-document tier
    recomputed_tokens: int = 0  # tokens of an assembled prefix recomputed with full context
    reuse_note: str | None = None  # why the per-document tier could not serve this model
    finish_reason: str = "stop"  # stop | length
    stop_sequence: str | None = None  # the stop string that ended the answer
    decode_reselections: int = 0  # layer selections of decode-phase SnapKV
    drafted_tokens: int = 0  # answer tokens drafted on the full cache to vote (lookahead)
    # which prefill computed the prompt: full | propagate (query-aware: layers from
    # propagate_layer on ran over propagated_tokens of the prompt); full_path_reason: why
    # a press that asked for propagation took the full path
    prefill_path: str = "full"
    propagate_layer: int | None = None
    propagated_tokens: int | None = None
    full_path_reason: str | None = None
    drafts_proposed: int = 0  # drafted tokens decode steps fed for the model to check
    drafts_kept: int = 0  # of them, those the model confirmed (answer tokens it gave)
    dropped_doc_ids: list[str] = field(default_factory=list)
    truncated_doc_ids: list[str] = field(default_factory=list)
    replica: str | None = None  # the Ray Serve replica that answered (None: in-process)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
