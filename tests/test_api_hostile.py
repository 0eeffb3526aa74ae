"""Hostile and careless requests through the real app: extreme sampling values, lone
surrogates, token limits, two Authorization headers, Host checks, the API description
behind the auth setting, the per-key rate limit, stalled bodies, /readyz asking the store."""

from __future__ import annotations

import json
import socket
import time
import uuid
from urllib.parse import urlsplit

import pytest

from tests.api_helpers import DOCS, FAST, running_server
from tests.local_client import LocalClient

pytestmark = pytest.mark.model

KEY, OTHER_KEY = "hostile-key-1", "hostile-key-2"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _app(engine, **settings):
    from ragsnap.api.app import create_app
    from ragsnap.api.settings import Settings

    return create_app(Settings(**settings), engine=engine)


@pytest.fixture(scope="module")
def client(engine):
    app = _app(
        engine,
        api_keys=f"{KEY},{OTHER_KEY}",
        max_document_tokens=60,
        max_question_tokens=40,
        max_prompt_tokens=120,
        max_new_tokens_limit=8,
    )
    with LocalClient(app) as test_client:
        yield test_client


def native(**overrides):
    return {
        "question": "What causes tides?",
        "documents": DOCS,
        "compression": FAST,
        "max_new_tokens": 2,
        **overrides,
    }


def chat(content="What causes tides?", **overrides):
    return {
        "model": "ragsnap",
        "messages": [{"role": "user", "content": content}],
        "documents": DOCS,
        "compression": FAST,
        "max_tokens": 2,
        **overrides,
    }


def raw(client, path, payload, headers=AUTH):
    """POST ``payload`` as ASCII JSON: a lone surrogate travels as its ``\\ud800`` escape."""
    data = json.dumps(payload, ensure_ascii=True)
    return client.post(path, content=data, headers={**headers, "Content-Type": "application/json"})


def error_of(response, status):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


# -- sampling values ----------------------------------------------------------------------

EXTREME_SAMPLING = [
    {"temperature": 1e-45},
    {"temperature": 5e-324},
    {"temperature": 0.7, "top_p": 1e-46},
    {"temperature": 0.7, "top_p": 5e-324, "seed": 2**63 - 1},
    {"temperature": 2.0, "seed": -(2**63)},
]


@pytest.mark.parametrize("sampling", EXTREME_SAMPLING)
def test_extreme_sampling_values_answer_on_both_routes(client, sampling):
    answered = raw(client, "/v1/answer", native(**sampling))
    assert answered.status_code == 200, answered.text
    assert answered.json()["stats"]["new_tokens"] >= 1
    completed = raw(client, "/v1/chat/completions", chat(**sampling))
    assert completed.status_code == 200, completed.text
    assert completed.json()["choices"][0]["message"]["content"] is not None


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("seed", 2**63 + 1),
        ("seed", 2**64),
        ("seed", -(2**63) - 1),
        ("temperature", 2.5),
        ("top_p", 0),
    ],
)
def test_out_of_range_sampling_values_are_refused(client, field, value):
    assert error_of(raw(client, "/v1/answer", native(**{field: value})), 422)["param"] == field
    assert error_of(raw(client, "/v1/chat/completions", chat(**{field: value})), 400)["param"] == (
        field
    )


def test_the_schema_states_the_sampling_bounds(engine):
    with LocalClient(_app(engine)) as public:
        schema = public.get("/openapi.json").json()["components"]["schemas"]
    seed = next(s for s in schema["AnswerRequest"]["properties"]["seed"]["anyOf"] if "type" in s)
    assert seed.get("type") == "integer"
    assert seed["minimum"] == -(2**63) and seed["maximum"] == 2**63
    temperature = schema["AnswerRequest"]["properties"]["temperature"]
    assert temperature["minimum"] == 0 and temperature["maximum"] == 2
    assert schema["AnswerRequest"]["properties"]["top_p"]["exclusiveMinimum"] == 0


# -- surrogates -----------------------------------------------------------------------


def test_a_lone_surrogate_is_refused_on_both_routes(client):
    bad = "What causes \ud800 tides?"
    error = error_of(raw(client, "/v1/answer", native(question=bad)), 422)
    assert error["param"] == "question"
    assert "unicode" in error["message"].lower() or "surrogate" in error["message"]
    error = error_of(raw(client, "/v1/chat/completions", chat(bad)), 400)
    assert error["param"].startswith("messages[0].content")
    parts = [{"type": "text", "text": bad}]
    error = error_of(raw(client, "/v1/chat/completions", chat(parts)), 400)
    assert error["param"].startswith("messages[0].content")
    docs = [{"id": "x", "title": "T\udfff", "text": "fine"}]
    error = error_of(raw(client, "/v1/answer", native(documents=docs)), 422)
    assert error["param"] == "documents[0].title"


def test_a_surrogate_pair_is_an_ordinary_character(client):
    response = raw(client, "/v1/answer", native(question="What causes tides? \U0001f30a"))
    assert response.status_code == 200, response.text


# -- token limits ---------------------------------------------------------------------


def test_token_limits_count_tokens_not_bytes(client):
    emoji = [{"id": "e", "text": "\U0001f600" * 40}]  # 160 bytes, well over 60 tokens
    error = error_of(raw(client, "/v1/answer", native(documents=emoji)), 413)
    assert error["code"] == "document_too_many_tokens" and error["param"] == "documents[0].text"
    question = "tides " * 50  # 300 characters, 50+ tokens
    error = error_of(raw(client, "/v1/answer", native(question=question)), 413)
    assert error["code"] == "question_too_many_tokens"
    error = error_of(raw(client, "/v1/chat/completions", chat(question)), 413)
    assert error["param"] == "messages"
    docs = [{"id": str(i), "text": "The Moon pulls the sea. " * 8} for i in range(4)]
    error = error_of(raw(client, "/v1/answer", native(documents=docs)), 413)
    assert error["code"] == "prompt_too_many_tokens"


# -- headers --------------------------------------------------------------------------


def test_two_authorization_headers_are_refused_whichever_comes_first(client):
    for first, second in ((KEY, "wrong"), ("wrong", KEY), (KEY, OTHER_KEY)):
        headers = [("Authorization", f"Bearer {first}"), ("Authorization", f"Bearer {second}")]
        error = error_of(client.get("/v1/models", headers=headers), 400)
        assert error["code"] == "duplicate_authorization"
    assert client.get("/v1/models", headers=AUTH).status_code == 200


def test_hosts_outside_allowed_hosts_are_refused(engine):
    app = _app(engine, allowed_hosts="api.example.com,*.internal")
    with LocalClient(app) as guarded:
        for host in ("evil.example", "api.example.com.evil.example", "internal"):
            error = error_of(guarded.get("/healthz", headers={"Host": host}), 400)
            assert error["code"] == "invalid_host"
        for host in ("api.example.com", "API.example.com:8000", "node-1.internal"):
            assert guarded.get("/healthz", headers={"Host": host}).status_code == 200


# -- the API description --------------------------------------------------------------


def test_docs_follow_the_auth_setting(engine):
    with LocalClient(_app(engine, api_keys=KEY)) as hidden:  # docs=auto with keys: off
        assert hidden.get("/openapi.json").status_code == 404
        assert hidden.get("/docs").status_code == 404
    with LocalClient(_app(engine, api_keys=KEY, docs="auth")) as keyed:
        assert error_of(keyed.get("/openapi.json"), 401)["code"] == "missing_api_key"
        assert keyed.get("/openapi.json", headers=AUTH).json()["info"]["title"] == "ragsnap"
    with LocalClient(_app(engine, api_keys=KEY, docs="public")) as public:
        assert public.get("/openapi.json").status_code == 200
    with LocalClient(_app(engine)) as open_server:  # docs=auto without keys: public
        assert open_server.get("/docs").status_code == 200


# -- rate limit -----------------------------------------------------------------------


def test_rate_limit_is_per_key_with_retry_after(engine):
    app = _app(engine, api_keys=f"{KEY},{OTHER_KEY}", rate_limit_per_minute=2)
    with LocalClient(app) as limited:
        assert [limited.get("/v1/models", headers=AUTH).status_code for _ in range(2)] == [
            200,
            200,
        ]
        refused = limited.get("/v1/models", headers=AUTH)
        error = error_of(refused, 429)
        assert error["code"] == "rate_limited" and error["type"] == "rate_limit_error"
        assert 1 <= int(refused.headers["Retry-After"]) <= 31
        other = {"Authorization": f"Bearer {OTHER_KEY}"}
        assert limited.get("/v1/models", headers=other).status_code == 200
        assert limited.get("/healthz").status_code == 200  # health is never limited


# -- stalled bodies -------------------------------------------------------------------


def _stalled_request(base: str, head: bytes, body: bytes) -> bytes:
    parts = urlsplit(base)
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        sock.sendall(head + body)  # then nothing more: the rest of the body never comes
        received = b""
        while b"\r\n\r\n" not in received:
            chunk = sock.recv(4096)
            if not chunk:
                break
            received += chunk
        return received


def test_a_stalled_body_is_cut_with_408(engine):
    app = _app(engine, body_timeout_s=0.3)
    with running_server(app) as base:
        head = (
            b"POST /v1/answer HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: 500\r\n\r\n"
        )
        reply = _stalled_request(base, head, b'{"question": "wh')
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        chunked = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        reply = _stalled_request(base, chunked, b'5\r\n{"mod\r\n')
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]


# -- /readyz asks the store -----------------------------------------------------------


def test_readyz_asks_redis_and_names_no_server_path(engine, redis_factory, tmp_path):
    from ragsnap.cache import open_store
    from ragsnap.engine.engine import RagSnapEngine

    server = redis_factory()
    eng = RagSnapEngine(engine.loaded, store=open_store(server.url, key="k"))
    with LocalClient(_app(eng, cache_ping_interval_s=0)) as ready:
        text = ready.get("/readyz").text
        assert json.loads(text)["cache"] == {"state": "ok", "backend": "redis"}
        assert str(server.port) not in text and "127.0.0.1" not in text
        server.stop()  # nothing asked the cache since: only a ping can know
        body = ready.get("/readyz").json()
        assert body["cache"]["state"] == "unavailable"
        server.start()
        assert ready.get("/readyz").json()["cache"]["state"] == "ok"
    eng = RagSnapEngine(engine.loaded, store=open_store(f"file://{tmp_path}"))
    with LocalClient(_app(eng)) as local:
        text = local.get("/readyz").text
        assert json.loads(text)["cache"] == {"state": "ok", "backend": "file"}
        assert str(tmp_path) not in text


def test_a_damaged_entry_is_counted_in_metrics(engine, tmp_path):
    from ragsnap.cache import open_store
    from ragsnap.engine.engine import RagSnapEngine

    # no prefix or document tier and no loaded copy of the entry: the repeat reads the
    # damaged file and computes the answer again
    eng = RagSnapEngine(
        engine.loaded,
        store=open_store(f"file://{tmp_path}"),
        prefix_cache=False,
        document_cache=False,
        hit_memory_mb=0,
    )
    ns_docs = [{"id": uuid.uuid4().hex, "text": "The Moon pulls the oceans."}]
    with LocalClient(_app(eng)) as served:
        first = served.post("/v1/answer", json=native(documents=ns_docs)).json()
        assert first["stats"]["cache"] == "miss"
        deadline = time.monotonic() + 30
        while not (entries := list((tmp_path / "default").glob("kv-*.kv"))):
            assert time.monotonic() < deadline, "the entry was never written"
            time.sleep(0.05)  # written by the store thread after the answer
        (entry,) = entries
        data = bytearray(entry.read_bytes())
        data[-3] ^= 0xFF
        entry.write_bytes(bytes(data))
        again = served.post("/v1/answer", json=native(documents=ns_docs)).json()
        assert again["stats"]["cache"] == "miss" and again["answer"] == first["answer"]
        metrics = served.get("/metrics").text
    assert 'ragsnap_cache_rejected_entries_total{reason="checksum"} 1.0' in metrics


def test_a_non_streaming_disconnect_is_logged_as_cancelled(engine, caplog):
    import logging

    import httpx

    caplog.set_level(logging.INFO, logger="ragsnap.api.access")
    with running_server(_app(engine)) as base:
        parts = urlsplit(base)
        data = json.dumps(native(max_new_tokens=200, compression=None)).encode()
        head = (
            f"POST /v1/answer HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n"
        ).encode()
        sock = socket.create_connection((parts.hostname, parts.port), timeout=30)
        sock.sendall(head + data)
        deadline = time.monotonic() + 120  # a bound for a broken server, not a measurement
        while not httpx.get(f"{base}/readyz").json()["queue"]["busy"]:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        sock.close()  # the client leaves while its answer is computed

        def answer_lines():
            lines = [json.loads(r.getMessage()) for r in caplog.records]
            return [line for line in lines if line.get("path") == "/v1/answer"]

        while not answer_lines():
            assert time.monotonic() < deadline
            time.sleep(0.05)
    (line,) = answer_lines()
    assert line["outcome"] == "cancelled"
