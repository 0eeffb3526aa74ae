"""Cache keys: sha256 over a canonical JSON of everything an entry depends on.

A compressed entry depends on the model (id, revision, dtype, device type), the prompt
template version, the press config, the ORDERED document content hashes and the
normalized question; the digest of the prompt's token ids is added as well, so that two
requests share an entry only when the model saw exactly the same prompt (a question that
normalizes the same but tokenizes differently, or a document truncated differently, gets
its own entry). A document entry (one document's body, computed after the prompt head)
depends on the model, the template, the head tokens, the document's content hash and its
body tokens, never on the question, the press or the other documents. A prefix entry depends on the model, the template, the document hashes and
the prefix tokens only, so any question over the same documents finds it. Keys are always
computed here from the request, never taken from a client.
"""

from __future__ import annotations

import hashlib
import json
import unicodedata
from array import array
from collections.abc import Sequence
from typing import Any

from ragsnap.cache.backends.store import DEFAULT_NAMESPACE, EntryKey
from ragsnap.cache.serialization import KIND_COMPRESSED, KIND_DOCUMENT, KIND_PREFIX


def normalize_question(question: str) -> str:
    """NFC, surrounding and repeated whitespace removed; case is kept (it can change answers)."""
    return " ".join(unicodedata.normalize("NFC", question).split())


def token_digest(token_ids: Sequence[int]) -> str:
    """sha256 of a token id sequence (as little-endian int64s)."""
    data = array("q", token_ids)
    if data.itemsize != 8 or array("q", [1]).tobytes()[0] != 1:  # pragma: no cover - exotic hosts
        return hashlib.sha256(json.dumps(list(token_ids)).encode()).hexdigest()
    return hashlib.sha256(data.tobytes()).hexdigest()


def canonical_digest(fields: dict[str, Any]) -> str:
    """sha256 hex of ``fields`` as canonical JSON (sorted keys, no spaces, UTF-8)."""
    text = json.dumps(
        fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str
    )
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def model_identity(model_id: str, revision: str, dtype: str, device_type: str) -> dict[str, str]:
    """The model part of every key (results differ across dtypes and device types)."""
    return {"model_id": model_id, "revision": revision, "dtype": dtype, "device": device_type}


def compressed_key(
    namespace: str | None,
    *,
    model: dict[str, str],
    template_version: str,
    press_config: dict[str, Any],
    doc_hashes: Sequence[str],
    question: str,
    prompt_ids: Sequence[int],
    storage_dtype: str | None = None,
) -> EntryKey:
    """Key of the compressed KV of one (documents, question, press) prompt."""
    digest = canonical_digest(
        {
            "kind": KIND_COMPRESSED,
            "model": model,
            "template": template_version,
            "press": press_config,
            "documents": list(doc_hashes),
            "question": normalize_question(question),
            "prompt_tokens": token_digest(prompt_ids),
            "storage_dtype": storage_dtype,
        }
    )
    return EntryKey(namespace or DEFAULT_NAMESPACE, KIND_COMPRESSED, digest)


def prefix_key(
    namespace: str | None,
    *,
    model: dict[str, str],
    template_version: str,
    doc_hashes: Sequence[str],
    prefix_ids: Sequence[int],
    storage_dtype: str | None = None,
) -> EntryKey:
    """Key of the full KV of a document prefix: no question, no press."""
    digest = canonical_digest(
        {
            "kind": KIND_PREFIX,
            "model": model,
            "template": template_version,
            "documents": list(doc_hashes),
            "prefix_tokens": token_digest(prefix_ids),
            "storage_dtype": storage_dtype,
        }
    )
    return EntryKey(namespace or DEFAULT_NAMESPACE, KIND_PREFIX, digest)


def document_key(
    namespace: str | None,
    *,
    model: dict[str, str],
    template_version: str,
    doc_hash: str,
    head_ids: Sequence[int],
    body_ids: Sequence[int],
    storage_dtype: str | None = None,
) -> EntryKey:
    """Key of one document body's full KV (the per-document tier): no question, no press,
    no order; the ``[n]`` label is outside the body, so any position and number share it."""
    digest = canonical_digest(
        {
            "kind": KIND_DOCUMENT,
            "model": model,
            "template": template_version,
            "document": doc_hash,
            "head_tokens": token_digest(head_ids),
            "body_tokens": token_digest(body_ids),
            "storage_dtype": storage_dtype,
        }
    )
    return EntryKey(namespace or DEFAULT_NAMESPACE, KIND_DOCUMENT, digest)
