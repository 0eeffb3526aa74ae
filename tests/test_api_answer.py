"""/v1/answer on the embedded model through a real uvicorn server: events, JSON, query, errors."""

from __future__ import annotations

import httpx
import pytest

from tests.api_helpers import DOCS, FAST, parse_sse, running_server


@pytest.fixture(scope="module")
def base_url(engine, tmp_path_factory):
    from ragsnap.api.app import create_app
    from ragsnap.api.settings import Settings

    corpus = tmp_path_factory.mktemp("corpus")
    (corpus / "moon.md").write_text(
        "The Moon pulls on the oceans.\n\nThat pull raises the tides twice a day."
    )
    (corpus / "bees.txt").write_text("Honeybees dance to show where the flowers are.")
    settings = Settings(
        corpus_dir=str(corpus),
        max_question_chars=100_000,
        max_question_tokens=100_000,  # the test overflows the context on purpose
        max_prompt_tokens=100_000,
        max_new_tokens_limit=64,
    )
    with running_server(create_app(settings, engine=engine)) as url:
        yield url


def request_body(**overrides):
    return {
        "question": "What causes tides?",
        "documents": DOCS,
        "max_new_tokens": 8,
        "compression": FAST,
        **overrides,
    }


def stream_events(base_url, body):
    with httpx.stream("POST", f"{base_url}/v1/answer", json=body, timeout=120) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return list(parse_sse(response.iter_lines()))


def test_stream_events_in_order_then_same_answer_as_json(base_url):
    events = stream_events(base_url, request_body(stream=True))
    names = [name for name, _ in events]
    assert names[0] == "meta" and names[-2:] == ["citations", "done"]
    assert set(names[1:-2]) == {"token"} and len(names) >= 4
    meta, done = events[0][1], events[-1][1]
    assert meta["prompt_tokens"] > FAST["budget"] == meta["kept_tokens"]
    assert [d["id"] for d in meta["documents"]] == ["bees", "tides"]
    assert meta["cache"] == done["stats"]["cache"]
    text = "".join(data["text"] for name, data in events if name == "token")
    assert text == done["answer"] and text.strip()
    assert events[-2][1]["citations"] == done["citations"]
    stats = done["stats"]
    assert stats["press"] == "snapkv" and stats["new_tokens"] <= 8
    assert stats["kv_bytes_kept"] < stats["kv_bytes_full"]

    # the JSON form carries the same content (greedy decoding: the same answer)
    response = httpx.post(f"{base_url}/v1/answer", json=request_body(), timeout=120)
    assert response.status_code == 200 and response.headers["content-type"] == "application/json"
    payload = response.json()
    assert set(payload) == {
        "answer",
        "answer_with_markers",
        "citations",
        "meta",
        "stats",
        # the verdict of the claim-level check (issue 43)
        "grounded",
        "grounded_score",
        "unsupported_sentences",
        "not_in_documents",
        "answer_not_in_documents",  # the answer's words no document holds (issue 53)
        "model_answer",
    }
    assert payload["grounded"] == done["grounded"] and payload["model_answer"] is None
    assert payload["answer_with_markers"] is None  # inline markers are off by default
    for citation in payload["citations"]:  # attribution: every citation has its quotes
        doc = next(d for d in request_body()["documents"] if d["id"] == citation["doc_id"])
        for quote in citation["quotes"]:
            assert doc["text"][quote["start"] : quote["end"]] == quote["text"]
    assert payload["answer"] == done["answer"]
    assert payload["meta"] == meta
    assert payload["stats"]["kept_tokens"] == stats["kept_tokens"]
    assert response.headers["x-request-id"]


def test_documents_go_by_relevance_unless_the_given_order_is_asked_for(base_url):
    reversed_docs = list(reversed(DOCS))  # tides first: the document the question is about
    by_relevance = httpx.post(
        f"{base_url}/v1/answer", json=request_body(documents=reversed_docs), timeout=120
    )
    given = httpx.post(
        f"{base_url}/v1/answer",
        json=request_body(documents=reversed_docs, document_order="given"),
        timeout=120,
    )
    assert [d["id"] for d in by_relevance.json()["meta"]["documents"]] == ["bees", "tides"]
    assert [d["id"] for d in given.json()["meta"]["documents"]] == ["tides", "bees"]
    wrong = httpx.post(
        f"{base_url}/v1/answer", json=request_body(document_order="random"), timeout=120
    )
    assert wrong.status_code == 422 and "document_order" in wrong.text


def test_query_answers_from_the_corpus(base_url):
    body = request_body(documents=None, query="why are there tides", top_k=1, max_new_tokens=2)
    response = httpx.post(f"{base_url}/v1/answer", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert [d["id"] for d in response.json()["meta"]["documents"]] == ["moon.md#1"]
    # no passage matches: an answer over no documents (tests/test_api_schema_rules.py)
    nothing = httpx.post(f"{base_url}/v1/answer", json={**body, "query": "zebra"}, timeout=120)
    assert nothing.status_code == 200 and nothing.json()["meta"]["documents"] == []


def test_engine_error_after_the_stream_started_is_an_error_event(base_url):
    # a question longer than the model's context is refused by the engine, after queueing
    huge = "why " * 9000
    events = stream_events(base_url, request_body(question=huge, stream=True))
    assert [name for name, _ in events] == ["error"]
    error = events[0][1]["error"]
    assert error["param"] == "question" and error["type"] == "invalid_request_error"
    response = httpx.post(f"{base_url}/v1/answer", json=request_body(question=huge), timeout=120)
    assert response.status_code == 422 and response.json()["error"]["param"] == "question"
    # the worker is still alive
    assert httpx.get(f"{base_url}/readyz").json()["queue"] == {"waiting": 0, "busy": False}
