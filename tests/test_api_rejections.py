"""Every way the service refuses a request, through the real app (no answer is computed)."""

from __future__ import annotations

import json
import logging
import time

import pytest

from tests.api_helpers import DOCS
from tests.local_client import LocalClient

KEY, OTHER_KEY = "test-key-1", "test-key-2"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def client(engine):
    from ragsnap.api.app import create_app
    from ragsnap.api.settings import Settings

    settings = Settings(
        api_keys=f"{KEY},{OTHER_KEY}",
        max_documents=3,
        max_document_bytes=400,
        max_total_bytes=700,
        max_question_chars=200,
        max_new_tokens_limit=32,
        max_body_bytes=4096,
    )
    with LocalClient(create_app(settings, engine=engine)) as test_client:
        yield test_client


def body(**overrides):
    return {"question": "What causes tides?", "documents": DOCS, "max_new_tokens": 4, **overrides}


def assert_error(response, status, param, code=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    if code:
        assert error["code"] == code
    # never a server path or a traceback
    assert "Traceback" not in error["message"] and "/work" not in error["message"]
    assert ".py" not in error["message"]
    return error


def test_missing_and_wrong_key_are_401(client):
    assert_error(client.post("/v1/answer", json=body()), 401, None, "missing_api_key")
    wrong = {"Authorization": "Bearer not-a-key"}
    error = assert_error(
        client.post("/v1/answer", json=body(), headers=wrong), 401, None, "invalid_api_key"
    )
    assert error["type"] == "authentication_error"
    assert client.get("/v1/models", headers=wrong).status_code == 401
    assert client.post("/v1/chat/completions", json={}, headers=wrong).status_code == 401


def test_too_many_documents_is_413(client):
    docs = [{"id": str(i), "text": f"document number {i}"} for i in range(4)]
    assert_error(
        client.post("/v1/answer", json=body(documents=docs), headers=AUTH),
        413,
        "documents",
        "too_many_documents",
    )


def test_document_and_total_bytes_are_413(client):
    big = [DOCS[0], {"id": "big", "text": "x" * 401}]
    assert_error(
        client.post("/v1/answer", json=body(documents=big), headers=AUTH),
        413,
        "documents[1].text",
        "document_too_large",
    )
    three = [{"id": str(i), "text": "y" * 300} for i in range(3)]
    assert_error(
        client.post("/v1/answer", json=body(documents=three), headers=AUTH),
        413,
        "documents",
        "documents_too_large",
    )


def test_oversized_body_is_413_before_parsing(client):
    payload = json.dumps(body(question="q" * 5000)).encode()
    response = client.post(
        "/v1/answer", content=payload, headers={**AUTH, "content-type": "application/json"}
    )
    assert_error(response, 413, "body", "body_too_large")

    def chunks():  # no Content-Length: the guard counts while reading
        yield payload[:2000]
        yield payload[2000:]

    response = client.post(
        "/v1/answer", content=chunks(), headers={**AUTH, "content-type": "application/json"}
    )
    assert_error(response, 413, "body", "body_too_large")


def test_long_question_is_413(client):
    assert_error(
        client.post("/v1/answer", json=body(question="why " * 60), headers=AUTH),
        413,
        "question",
        "question_too_long",
    )


def test_unknown_press_is_422_naming_the_field(client):
    response = client.post("/v1/answer", json=body(compression={"press": "zip"}), headers=AUTH)
    error = assert_error(response, 422, "compression.press")
    assert "zip" in error["message"] and "snapkv" in error["message"]


@pytest.mark.parametrize(
    "compression",
    [{"lookahead": -1}, {"lookahead": 65}, {"press": "h2o", "budget": 64, "lookahead": 4}],
)
def test_a_bad_lookahead_is_422_naming_it(client, compression):
    response = client.post("/v1/answer", json=body(compression=compression), headers=AUTH)
    assert_error(response, 422, "compression.lookahead")


def test_budget_and_ratio_together_is_422(client):
    response = client.post(
        "/v1/answer", json=body(compression={"budget": 64, "ratio": 0.5}), headers=AUTH
    )
    assert_error(response, 422, "compression")


def test_empty_question_is_422(client):
    assert_error(
        client.post("/v1/answer", json=body(question="   "), headers=AUTH), 422, "question"
    )
    assert_error(client.post("/v1/answer", json=body(question=""), headers=AUTH), 422, "question")


def test_malformed_json_is_422(client):
    response = client.post(
        "/v1/answer",
        content=b'{"question": "x", ',
        headers={**AUTH, "content-type": "application/json"},
    )
    assert_error(response, 422, "body", "json_invalid")


@pytest.mark.parametrize(
    ("path", "status"), [("/v1/answer", 422), ("/v1/search", 422), ("/v1/chat/completions", 400)]
)
def test_a_body_that_is_not_utf8_is_invalid_json_not_a_parse_failure(client, path, status):
    # bytes no JSON decoder can read (schemathesis found this on /v1/search)
    response = client.post(
        path, content=b"L\xff\xfe\x00D", headers={**AUTH, "content-type": "application/json"}
    )
    assert_error(response, status, "body", "json_invalid")


def test_field_errors_name_the_field(client):
    docs = [DOCS[0], {"id": "empty", "text": ""}]
    assert_error(
        client.post("/v1/answer", json=body(documents=docs), headers=AUTH), 422, "documents[1].text"
    )
    assert_error(
        client.post("/v1/answer", json=body(max_new_tokens=33), headers=AUTH), 422, "max_new_tokens"
    )
    assert_error(
        client.post("/v1/answer", json=body(max_new_tokens=0), headers=AUTH), 422, "max_new_tokens"
    )
    assert_error(
        client.post("/v1/answer", json={"documents": DOCS}, headers=AUTH),
        422,
        "question",
        "missing_field",
    )
    assert_error(
        client.post("/v1/answer", json=body(documents=None), headers=AUTH), 422, "documents"
    )
    assert_error(client.post("/v1/answer", json=body(query="tides"), headers=AUTH), 422, "query")
    assert_error(client.post("/v1/answer", json=body(colour="red"), headers=AUTH), 422, "colour")


def test_openai_route_answers_bad_input_with_400(client):
    chat = {
        "model": "ragsnap",
        "messages": [{"role": "user", "content": "What causes tides?"}],
        "documents": DOCS,
        "compression": {"press": "zip"},
    }
    assert_error(
        client.post("/v1/chat/completions", json=chat, headers=AUTH), 400, "compression.press"
    )
    no_user = {**chat, "compression": None, "messages": [{"role": "system", "content": "hi"}]}
    assert_error(client.post("/v1/chat/completions", json=no_user, headers=AUTH), 400, "messages")
    missing = {k: v for k, v in chat.items() if k != "messages"}
    assert_error(client.post("/v1/chat/completions", json=missing, headers=AUTH), 400, "messages")
    too_long = {**chat, "compression": None, "max_tokens": 99}
    assert_error(
        client.post("/v1/chat/completions", json=too_long, headers=AUTH), 400, "max_tokens"
    )
    bad_json = client.post(
        "/v1/chat/completions", content=b"{", headers={**AUTH, "content-type": "application/json"}
    )
    assert_error(bad_json, 400, "body", "json_invalid")
    unknown = {**chat, "compression": None, "model": "gpt-9"}
    assert_error(
        client.post("/v1/chat/completions", json=unknown, headers=AUTH),
        404,
        "model",
        "model_not_found",
    )


def test_health_ready_models_and_metrics(client):
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz").json()
    assert ready["status"] == "ready" and ready["model"]
    assert ready["cache"]["state"] in {"off", "ok", "unavailable"}
    models = client.get("/v1/models", headers=AUTH).json()
    assert models["object"] == "list"
    assert {m["id"] for m in models["data"]} == {ready["model"], "ragsnap"}
    client.post("/v1/answer", json=body(question=""), headers=AUTH)
    text = client.get("/metrics", headers=AUTH).text
    assert 'ragsnap_requests_total{route="/v1/answer",status="422"}' in text
    assert "ragsnap_queue_depth 0.0" in text
    assert "ragsnap_prefill_seconds_bucket" in text


def test_access_log_is_one_line_without_text(client, caplog):
    secret_text = "the-secret-document-text"
    docs = [{"id": "s", "text": secret_text}] * 4
    with caplog.at_level(logging.INFO, logger="ragsnap.api.access"):
        client.post("/v1/answer", json=body(documents=docs), headers=AUTH)
        client.post(
            "/v1/answer",
            json=body(documents=docs),
            headers={"Authorization": f"Bearer {OTHER_KEY}"},
        )
    lines = [r.getMessage() for r in caplog.records if r.name == "ragsnap.api.access"]
    assert len(lines) == 2
    records = [json.loads(line) for line in lines]
    assert all(
        r["status"] == 413 and r["path"] == "/v1/answer" and r["request_id"] for r in records
    )
    # one namespace per key, and neither the key nor any document text in the log
    assert records[0]["namespace"] != records[1]["namespace"]
    assert not any(secret_text in line or KEY in line or OTHER_KEY in line for line in lines)


def test_not_ready_is_503_while_health_answers(tmp_path):
    from ragsnap.api.app import create_app
    from ragsnap.api.settings import Settings

    # no engine given: the app loads one in the background, and this one cannot load
    app = create_app(Settings(model=str(tmp_path / "no-such-model"), cache_url="none"))
    with LocalClient(app) as test_client:
        assert test_client.get("/healthz").status_code == 200
        deadline = time.monotonic() + 120  # the failure comes once transformers is imported
        while True:
            ready = test_client.get("/readyz")
            if ready.json()["status"] != "loading" or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert ready.status_code == 503 and ready.json()["status"] == "failed"
        assert str(tmp_path) not in ready.text
        response = test_client.post("/v1/answer", json=body())
        assert_error(response, 503, None, "not_ready")
        assert response.headers["retry-after"]
