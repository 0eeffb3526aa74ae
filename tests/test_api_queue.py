"""The bounded queue (429 with Retry-After) and cancellation when a client disconnects."""

from __future__ import annotations

import re
import threading
import time

import httpx
import pytest

from tests.api_helpers import DOCS, FAST, parse_sse, running_server


@pytest.fixture(scope="module")
def base_url(engine):
    from ragsnap.api.app import create_app
    from ragsnap.api.settings import Settings

    settings = Settings(max_queue=1, max_new_tokens_limit=400, max_batch=1)  # serial: a queue forms
    with running_server(create_app(settings, engine=engine)) as url:
        yield url


def wait_for(predicate, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def metric(base_url, name):
    text = httpx.get(f"{base_url}/metrics").text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, flags=re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_full_queue_is_429_and_cancelled_jobs_free_the_worker(base_url):
    long_answer = {
        "question": "List every word of both documents, one per line, then repeat the list.",
        "documents": DOCS,
        "max_new_tokens": 400,
        "compression": FAST,
        "stream": True,
    }
    short = {
        "question": "What causes tides?",
        "documents": DOCS,
        "max_new_tokens": 2,
        "compression": FAST,
    }
    gave_up = threading.Event()

    def impatient_request():  # non-streaming, waits in the queue, then leaves
        try:
            httpx.post(f"{base_url}/v1/answer", json=short, timeout=httpx.Timeout(30, read=6))
        except httpx.ReadTimeout:
            gave_up.set()

    with httpx.stream("POST", f"{base_url}/v1/answer", json=long_answer, timeout=300) as running:
        events = parse_sse(running.iter_lines())
        assert next(events)[0] == "meta"
        assert next(events)[0] == "token"  # the worker is decoding the long answer
        waiter = threading.Thread(target=impatient_request)
        waiter.start()
        wait_for(lambda: httpx.get(f"{base_url}/readyz").json()["queue"]["waiting"] == 1)

        refused = httpx.post(f"{base_url}/v1/answer", json=short, timeout=30)
        assert refused.status_code == 429
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["code"] == "queue_full"
        assert refused.json()["error"]["type"] == "rate_limit_error"
        waiter.join(60)
        assert gave_up.is_set()
    # leaving the block closed the stream mid-answer: the worker drops it (it would
    # otherwise decode 400 tokens), skips the queued request whose client left, and is
    # free for the next one
    answered = httpx.post(f"{base_url}/v1/answer", json=short, timeout=300)
    assert answered.status_code == 200, answered.text
    assert answered.json()["stats"]["new_tokens"] <= 2
    wait_for(
        lambda: metric(base_url, 'ragsnap_answers_total{outcome="cancelled"}') == 1.0, timeout=30
    )
    assert metric(base_url, 'ragsnap_answers_total{outcome="skipped"}') == 1.0
    assert metric(base_url, 'ragsnap_answers_total{outcome="ok"}') == 1.0
    assert metric(base_url, "ragsnap_queue_rejections_total") == 1.0
    assert httpx.get(f"{base_url}/readyz").json()["queue"] == {"waiting": 0, "busy": False}
