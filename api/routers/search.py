"""``POST /v1/search``: the corpus passages a query finds (the playground's corpus search)."""

from __future__ import annotations

from fastapi import APIRouter

from ragsnap.api.deps import ServicesDep, SettingsDep
from ragsnap.api.errors import ApiError
from ragsnap.api.openapi import errors
from ragsnap.api.schemas import PassageOut, SearchRequest, SearchResponse

router = APIRouter(tags=["search"])


@router.post(
    "/v1/search", response_model=SearchResponse, responses=errors(401, 408, 413, 422, 429, 503)
)
def search(body: SearchRequest, services: ServicesDep, settings: SettingsDep) -> SearchResponse:
    """BM25 over the server's corpus, best first; passages sharing no term are left out.
    A sync route: FastAPI runs it in its thread pool, off the event loop."""
    if services.index is None:
        raise ApiError(
            422,
            "query: this server has no corpus (set RAGSNAP_CORPUS_DIR)",
            param="query",
            code="no_corpus",
        )
    top_k = body.top_k if body.top_k is not None else settings.default_top_k
    if top_k > settings.max_top_k:
        raise ApiError(
            422, f"top_k: at most {settings.max_top_k}", param="top_k", code="invalid_value"
        )
    found = services.index.search(body.query, top_k)
    return SearchResponse(
        passages=[
            PassageOut(
                id=hit.document.id,
                title=hit.document.title,
                text=hit.document.text,
                score=round(hit.score, 4),
            )
            for hit in found
        ]
    )
