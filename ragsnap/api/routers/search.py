"""``POST /v1/search``: the corpus passages a query finds (the playground's corpus search)."""

from __future__ import annotations

from fastapi import APIRouter

from ragsnap.api.answering import corpus_top_k
from ragsnap.api.deps import ServicesDep, SettingsDep
from ragsnap.api.openapi import errors
from ragsnap.api.schemas import PassageOut, SearchRequest, SearchResponse

router = APIRouter(tags=["search"])


@router.post(
    "/v1/search", response_model=SearchResponse, responses=errors(400, 401, 408, 413, 422, 429, 503)
)
def search(body: SearchRequest, services: ServicesDep, settings: SettingsDep) -> SearchResponse:
    """BM25 over the server's corpus, best first; passages sharing no term are left out.
    A sync route: FastAPI runs it in its thread pool, off the event loop."""
    top_k = corpus_top_k(services, settings, body.top_k)
    assert services.index is not None
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
