"""``kept_tokens: true`` on /v1/answer (embedded model, real server): per document, each
token's character span and the share of layers and KV heads that kept it; and /v1/search."""

from __future__ import annotations

import httpx
import pytest

from tests.api_helpers import DOCS, FAST, parse_sse, running_server

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def base_url(engine, tmp_path_factory):
    from ragsnap.api.app import create_app
    from ragsnap.api.settings import Settings
    from ragsnap.cache import open_store
    from ragsnap.engine.engine import RagSnapEngine

    corpus = tmp_path_factory.mktemp("corpus")
    (corpus / "moon.md").write_text("The Moon pulls on the oceans, which raises the tides.")
    (corpus / "bees.txt").write_text("Honeybees dance to show where the flowers are.")
    store = open_store(f"file://{tmp_path_factory.mktemp('kv')}")
    cached = RagSnapEngine(engine.loaded, store=store)  # the same loaded model, with a store
    settings = Settings(corpus_dir=str(corpus), max_new_tokens_limit=64)
    with running_server(create_app(settings, engine=cached)) as url:
        yield url


def body(**overrides):
    return {
        "question": "What causes tides?",
        "documents": DOCS,
        "max_new_tokens": 8,
        "compression": FAST,
        "kept_tokens": True,
        **overrides,
    }


def test_kept_token_spans_lie_in_their_documents_with_shares_that_differ(base_url):
    payload = httpx.post(f"{base_url}/v1/answer", json=body(), timeout=120).json()
    maps = payload["kept_tokens"]
    assert [(m["index"], m["doc_id"]) for m in maps] == [(1, "bees"), (2, "tides")]
    shares = []
    for doc, kept in zip(DOCS, maps, strict=True):
        spans = kept["spans"]
        assert spans and spans[0]["start"] < 3  # the text from its first token on
        assert spans[-1]["end"] == len(doc["text"])
        ends = 0
        for span in spans:
            assert 0 <= span["start"] < span["end"] <= len(doc["text"])
            assert span["start"] >= ends - 1  # in order (byte tokens may share a character)
            ends = span["end"]
            assert 0.0 <= span["share"] <= 1.0
        # the spans are the document's tokens: together they spell its words
        words = "".join(doc["text"][s["start"] : s["end"]] for s in spans).split()
        assert words == doc["text"].split()
        mean = sum(s["share"] for s in spans) / len(spans)
        assert kept["kept_share"] == pytest.approx(mean, abs=1e-3)
        shares += [s["share"] for s in spans]
    # a budget of 48 of ~100 prompt tokens: some tokens kept by every head, some by none
    assert min(shares) < max(shares) and min(shares) < 0.5 and max(shares) > 0.5
    assert payload["stats"]["kept_tokens"] == FAST["budget"] < payload["stats"]["prompt_tokens"]


def test_kept_tokens_ride_on_the_done_event_and_only_when_asked(base_url):
    with httpx.stream("POST", f"{base_url}/v1/answer", json=body(stream=True), timeout=120) as r:
        events = list(parse_sse(r.iter_lines()))
    done = events[-1][1]
    assert events[-1][0] == "done" and [m["doc_id"] for m in done["kept_tokens"]] == [
        "bees",
        "tides",
    ]
    plain = httpx.post(f"{base_url}/v1/answer", json=body(kept_tokens=False), timeout=120).json()
    assert "kept_tokens" not in plain  # the answer's shape is unchanged unless asked
    assert plain["answer"] == done["answer"]
    # a stop string rebuilds the done event: the maps stay on it
    stopped = httpx.post(f"{base_url}/v1/answer", json=body(stop=["never-said"]), timeout=120)
    assert stopped.json()["kept_tokens"] == done["kept_tokens"]


def test_a_cache_hit_has_the_same_map(base_url):
    request = body(question="What do honeybees do?")
    first = httpx.post(f"{base_url}/v1/answer", json=request, timeout=120).json()
    again = httpx.post(f"{base_url}/v1/answer", json=request, timeout=120).json()
    # computed the first time (from the prefix or document tiers when an earlier test sent
    # these documents); then the whole answer is cached
    assert first["stats"]["cache"] != "hit" and again["stats"]["cache"] == "hit"
    assert again["kept_tokens"] == first["kept_tokens"]
    assert any(s["share"] < 1.0 for m in again["kept_tokens"] for s in m["spans"])


def test_full_press_keeps_every_token(base_url):
    payload = httpx.post(
        f"{base_url}/v1/answer", json=body(compression={"press": "full"}), timeout=120
    ).json()
    assert all(s["share"] == 1.0 for m in payload["kept_tokens"] for s in m["spans"])


def test_search_returns_corpus_passages_best_first(base_url):
    response = httpx.post(f"{base_url}/v1/search", json={"query": "tides moon", "top_k": 2})
    assert response.status_code == 200
    passages = response.json()["passages"]
    assert passages[0]["text"].startswith("The Moon pulls")
    assert all(p["score"] > 0 for p in passages)
    assert [p["score"] for p in passages] == sorted((p["score"] for p in passages), reverse=True)
    too_many = httpx.post(f"{base_url}/v1/search", json={"query": "tides", "top_k": 999})
    assert too_many.status_code == 422 and too_many.json()["error"]["param"] == "top_k"
