"""The Ray Serve application against a real local Ray cluster (two engine replicas on CPU,
a tiny random model, a real Redis as the shared KV cache), deployed from ``deploy/serve.yaml``."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

pytest.importorskip("ray.serve")

from tests.api_helpers import DOCS, FAST, parse_sse, running_server  # noqa: E402
from tests.ray_cluster import ray_app  # noqa: E402
from tests.tiny_models import save_tiny_model  # noqa: E402

KEY, BURST_KEY = "k-ray-test", "k-ray-burst"
AUTH = {"Authorization": f"Bearer {KEY}"}
SETTINGS = {
    "device": "cpu",
    "api_keys": f"{KEY},{BURST_KEY}",
    "max_queue": 2,
    "max_batch": 2,
    "max_question_chars": 300,
    "max_question_tokens": 24,
    "max_new_tokens_limit": 900,  # the tiny model has 1024 positions
    "rate_limit_per_minute": 60,
    "rate_limit_burst": 30,
}


def ask(question="t5 t6 t7?", documents=DOCS, tokens=4, **extra):
    return {
        "question": question,
        "documents": documents,
        "max_new_tokens": tokens,
        "compression": FAST,
        **extra,
    }


def other_docs(i):
    return [{"id": f"d{i}", "title": f"Doc {i}", "text": f"t{10 + i} t{20 + i} t{30 + i}."}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, redis_server):
    model = save_tiny_model(tmp_path_factory.mktemp("tiny-model"))
    settings = {
        **SETTINGS,
        "model": model,
        "cache_url": f"{redis_server.url}?ttl=600",
        "cache_key": "ray-test-secret",  # replicas share the Redis store, so its key
    }
    with ray_app(settings, AUTH, replicas=2, replica_cpus=0.5, ingress_cpus=0.25) as app:
        yield app


@pytest.fixture(scope="module")
def local_url(cluster):
    """The single-process server with the same settings (no cache), for comparisons."""
    from ragsnap.api.app import create_app
    from ragsnap.api.services import load_engine
    from ragsnap.api.settings import Settings

    settings = Settings(**{**cluster.settings, "cache_url": "none"})
    with running_server(create_app(settings, engine=load_engine(settings))) as url:
        yield url


def answer(url, body, headers=AUTH):
    response = httpx.post(f"{url}/v1/answer", json=body, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def replica_of(cluster, documents):
    """The replica the router sends ``documents`` to (a call routed like an answer)."""
    from ragsnap.api.ray_backend import route_key

    key = route_key(_namespace(), _documents(documents))
    return cluster.engine_handle().load.remote(route_key=key).result()


def test_two_replicas_answer_streamed_and_whole(cluster):
    whole = answer(cluster.url, ask())
    assert whole["stats"]["replica"] and whole["stats"]["new_tokens"] == 4
    with httpx.stream(
        "POST", f"{cluster.url}/v1/answer", json=ask(stream=True), headers=AUTH, timeout=120
    ) as response:
        assert response.status_code == 200
        events = list(parse_sse(response.iter_lines()))
    names = [name for name, _ in events]
    assert names[0] == "meta" and names.count("token") >= 1 and names[-1] == "done"
    done = events[-1][1]
    assert done["answer"] == whole["answer"]  # greedy: the same answer either way
    assert done["stats"]["replica"] == whole["stats"]["replica"]  # same documents, same replica
    replicas = {replica_of(cluster, other_docs(i))["replica"] for i in range(12)}
    assert len(replicas) == 2  # two live replicas, both given document sets


def test_serve_proxy_answers_as_the_direct_ingress(cluster):
    via_proxy = answer(cluster.proxy_url, ask())
    assert via_proxy["answer"] == answer(cluster.url, ask())["answer"]
    refused = [
        httpx.post(f"{url}/v1/answer", json=ask()) for url in (cluster.url, cluster.proxy_url)
    ]
    assert [r.status_code for r in refused] == [401, 401]
    assert refused[0].json() == refused[1].json()


def test_openai_client_works_through_the_ingress(cluster):
    from openai import OpenAI

    client = OpenAI(base_url=f"{cluster.url}/v1", api_key=KEY, max_retries=0)
    extra = {"documents": DOCS, "compression": FAST}
    messages = [{"role": "user", "content": "t5 t6?"}]
    completion = client.chat.completions.create(
        model="ragsnap", messages=messages, max_tokens=3, extra_body=extra
    )
    assert completion.choices[0].message.content
    assert completion.model_extra["ragsnap"]["replica"]
    chunks = list(
        client.chat.completions.create(
            model="ragsnap", messages=messages, max_tokens=3, stream=True, extra_body=extra
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == completion.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_same_document_set_same_replica_and_shared_cache(cluster):
    docs = other_docs(40)
    first = answer(cluster.url, ask("t9 t9?", docs))
    assert first["stats"]["cache"] == "miss"
    again = [answer(cluster.url, ask(f"t{n} t9?", docs)) for n in (3, 4)]
    assert {a["stats"]["replica"] for a in again} == {first["stats"]["replica"]}
    home = first["stats"]["replica"]
    # a document set whose home is the other replica exists among a few
    away = next(i for i in range(41, 60) if replica_of(cluster, other_docs(i))["replica"] != home)
    assert answer(cluster.url, ask(documents=other_docs(away)))["stats"]["replica"] != home
    # the same request answered by the other replica: a hit in the shared Redis cache
    hit = _answer_elsewhere(cluster, ask("t9 t9?", docs), home)
    assert hit.stats.cache == "hit" and hit.stats.replica != home
    assert hit.answer == first["answer"]


def _documents(documents):
    from ragsnap.prompt.documents import Document

    return [Document(id=d["id"], title=d["title"], text=d["text"]) for d in documents]


def _namespace():
    from ragsnap.api.settings import Settings

    return Settings(api_keys=KEY).key_digests().popitem()[1]


def _answer_elsewhere(cluster, body, avoid):
    """``body`` answered by a replica other than ``avoid``: sent to the engine deployment
    with the route key of a document set whose home is another replica."""
    from ragsnap.api.answering import answer_options
    from ragsnap.api.ray_backend import Admission, RemoteAnswer, route_key
    from ragsnap.api.schemas import CompressionIn
    from ragsnap.api.settings import Settings
    from ragsnap.engine.events import DoneEvent

    options = answer_options(
        CompressionIn(**FAST),
        Settings(**cluster.settings),
        max_new_tokens=body["max_new_tokens"],
        temperature=None,
        top_p=None,
        seed=None,
    )
    request = RemoteAnswer(
        "elsewhere", body["question"], _documents(body["documents"]), options, _namespace()
    )
    other = next(i for i in range(60, 90) if replica_of(cluster, other_docs(i))["replica"] != avoid)
    key = route_key(_namespace(), _documents(other_docs(other)))
    stream = cluster.engine_handle().options(stream=True).answer.remote(request, route_key=key)
    admission, *batches = list(stream)
    assert isinstance(admission, Admission) and admission.accepted
    events = [event for batch in batches for event in batch]
    assert isinstance(events[-1], DoneEvent)
    return events[-1]


REJECTED = [  # (headers, path, body): each refused before any engine work
    ({}, "/v1/answer", ask()),
    ({"Authorization": "Bearer wrong"}, "/v1/answer", ask()),
    (AUTH, "/v1/answer", ask("t5 " * 120)),  # over max_question_chars: 413
    (AUTH, "/v1/answer", ask("t5 " * 40)),  # over max_question_tokens (the tokenizer): 413
    (AUTH, "/v1/answer", ask(tokens=901)),  # over max_new_tokens_limit: 422
    (AUTH, "/v1/answer", {"question": "t5?"}),  # no documents: 422
    (
        AUTH,
        "/v1/chat/completions",
        {"model": "nope", "messages": [{"role": "user", "content": "x"}]},
    ),
    (
        AUTH,
        "/v1/chat/completions",
        {
            "model": "ragsnap",
            "tools": [{"type": "function"}],
            "messages": [{"role": "user", "content": "x"}],
        },
    ),
]


def test_auth_and_limits_answer_as_in_process(cluster, local_url):
    for headers, path, body in REJECTED:
        got = [
            httpx.post(f"{url}{path}", json=body, headers=headers, timeout=60)
            for url in (cluster.url, local_url)
        ]
        ray_side, local = got
        assert ray_side.status_code == local.status_code and ray_side.status_code >= 400
        assert ray_side.json() == local.json()
        assert ray_side.headers.get("www-authenticate") == local.headers.get("www-authenticate")


def test_rate_limit_429_as_in_process(cluster, local_url):
    headers = {"Authorization": f"Bearer {BURST_KEY}"}
    for url in (cluster.url, local_url):
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            codes = list(
                pool.map(
                    lambda u: httpx.get(u, headers=headers).status_code, [f"{url}/v1/models"] * 45
                )
            )
        assert set(codes) == {200, 429} and codes.count(200) >= 30  # the burst, then refused
        # the bucket refills one token a second: a slow run may have earned one back
        tries = [httpx.get(f"{url}/v1/models", headers=headers) for _ in range(3)]
        limited = next(r for r in tries if r.status_code == 429)
        assert int(limited.headers["Retry-After"]) >= 1
        assert limited.json()["error"]["code"] == "rate_limited"


def test_full_replica_queue_is_429_and_disconnects_cancel_in_the_replica(cluster):
    docs = other_docs(91)
    home = replica_of(cluster, docs)
    body = ask("t5 t6?", docs, tokens=900, stream=True)

    def start(_):
        client = httpx.Client(timeout=120, headers=AUTH)
        response = client.send(
            client.build_request("POST", f"{cluster.url}/v1/answer", json=body), stream=True
        )
        return client, response

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        opened = list(pool.map(start, range(8)))
    try:
        codes = sorted(r.status_code for _, r in opened)
        # at most max_batch 2 answering + max_queue 2 waiting, on the documents' one replica
        accepted = codes.count(200)
        assert 2 <= accepted <= 4 and codes.count(429) == 8 - accepted, codes
        refused = next(r for _, r in opened if r.status_code == 429)
        refused.read()
        assert refused.json()["error"]["code"] == "queue_full" and refused.headers["Retry-After"]
        load = replica_of(cluster, docs)
        # every accepted request is on the documents' replica (one of the tiny random
        # model's answers may already have met its end-of-turn token: at most, not exactly)
        assert load["replica"] == home["replica"]
        assert 1 <= load["answering"] + load["waiting"] <= accepted, (load, accepted)
    finally:
        for client, response in opened:
            response.close()
            client.close()
    deadline = time.monotonic() + 30
    while (load := replica_of(cluster, docs))["answering"] + load["waiting"]:
        assert time.monotonic() < deadline, load
        time.sleep(0.1)
    # the answers still running or waiting were stopped in the replica by the disconnects
    assert 1 <= load["cancelled"] - home["cancelled"] <= accepted


def _wait_load(cluster, docs, ready, what):
    deadline = time.monotonic() + 60
    while not ready(load := replica_of(cluster, docs)):
        assert time.monotonic() < deadline, f"{what}: {load}"
        time.sleep(0.05)
    return load


def test_a_replica_dead_before_it_sent_anything_is_replaced_for_the_request(cluster):
    """A request queued in a replica (admitted, nothing streamed yet) when the replica dies
    is sent again, to the other replica, and answered there."""
    import ray

    docs = other_docs(94)
    home = replica_of(cluster, docs)
    opened = []

    def open_stream(tokens):
        client = httpx.Client(timeout=60, headers=AUTH)
        body = ask("t5 t6?", docs, tokens=tokens, stream=True)
        response = client.send(
            client.build_request("POST", f"{cluster.url}/v1/answer", json=body), stream=True
        )
        opened.append((client, response))
        assert response.status_code == 200
        return response

    try:
        for _ in range(2):  # max_batch 2: the replica's batch is full with these
            open_stream(900)
        _wait_load(cluster, docs, lambda load: load["answering"] == 2, "two answering")
        queued = open_stream(6)
        _wait_load(cluster, docs, lambda load: load["waiting"] == 1, "one waiting")
        ray.kill(ray.get_actor(home["actor_name"], namespace="serve"), no_restart=True)
        events = list(parse_sse(queued.iter_lines()))  # ends: no hang
    finally:
        for client, response in opened:
            response.close()
            client.close()
    names = [name for name, _ in events]
    assert "error" not in names and names[0] == "meta" and names[-1] == "done", names
    assert events[-1][1]["stats"]["replica"] not in (None, home["replica"])
    assert events[-1][1]["stats"]["new_tokens"] == 6


def test_a_dead_replica_ends_its_streams_cleanly_and_the_other_answers(cluster):
    import ray

    docs = other_docs(92)
    home = replica_of(cluster, docs)
    body = ask("t5 t6?", docs, tokens=400, stream=True)
    with httpx.stream(
        "POST", f"{cluster.url}/v1/answer", json=body, headers=AUTH, timeout=60
    ) as response:
        events = parse_sse(response.iter_lines())
        assert next(events)[0] == "meta" and next(events)[0] == "token"
        ray.kill(ray.get_actor(home["actor_name"], namespace="serve"), no_restart=True)
        rest = list(events)  # ends: no hang
    assert rest[-1][0] == "error" and rest[-1][1]["error"]["code"] == "replica_failed"
    statuses, answered_by = [], set()
    for i in range(6):
        response = httpx.post(
            f"{cluster.url}/v1/answer",
            json=ask(documents=docs if i % 2 else other_docs(93 + i)),
            headers=AUTH,
            timeout=60,
        )
        statuses.append(response.status_code)
        if response.status_code == 200:
            answered_by.add(response.json()["stats"]["replica"])
    assert set(statuses) <= {200, 503} and statuses.count(200) >= 4, statuses
    assert home["replica"] not in answered_by
