"""The ingress's Ray backend against a fake deployment handle: admission, relaying,
retries on a dead replica, cancellation (no Ray cluster: milliseconds)."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("ray")

from ray.exceptions import ActorDiedError  # noqa: E402

from ragsnap.api.ray_backend import Admission, RayAnswerBackend  # noqa: E402
from ragsnap.api.worker import AnswerJob, JobFailure, QueueFullError, WorkerStoppedError  # noqa: E402
from ragsnap.engine.events import MetaEvent, TokenEvent  # noqa: E402
from ragsnap.prompt.documents import Document  # noqa: E402

META = MetaEvent(prompt_tokens=10, kept_tokens=8, cache="miss", documents=[])
DIED = ActorDiedError()


class FakeStream:
    """A streaming call: yields ``items``, then raises ``fail`` (or ends, or hangs)."""

    def __init__(self, items, fail=None, hang=False):
        self.items, self.fail, self.hang, self.cancelled = list(items), fail, hang, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.sleep(0)
        if self.items:
            return self.items.pop(0)
        if self.fail is not None:
            raise self.fail
        if self.hang:
            await asyncio.sleep(3600)
        raise StopAsyncIteration

    def cancel(self):
        self.cancelled = True


class FakeHandle:
    def __init__(self, *streams):
        self.streams, self.keys = list(streams), []

    def options(self, **_):
        return self

    def remote(self, request, route_key):
        self.keys.append(route_key)
        return self.streams.pop(0)


def make_job():
    from ragsnap.api.answering import answer_options
    from ragsnap.api.settings import Settings

    options = answer_options(
        None, Settings(), max_new_tokens=4, temperature=None, top_p=None, seed=None
    )
    return AnswerJob("r1", "q?", [Document(id="a", text="x", title="A")], options)


async def run(backend, job):
    await backend.admit(job)
    items = [item async for item in job.stream()]
    return items


def backend_for(*streams, **kwargs):
    from ragsnap.api.metrics import ServiceMetrics

    handle = FakeHandle(*streams)
    return RayAnswerBackend(handle, ServiceMetrics(), **kwargs), handle


async def test_a_replica_dead_before_any_event_is_replaced_for_the_same_request():
    dead = FakeStream([Admission(True, "a")], fail=DIED)
    good = FakeStream([Admission(True, "b"), [META, TokenEvent("hi")]])
    backend, handle = backend_for(dead, good)
    job = make_job()
    items = await run(backend, job)
    assert items[:2] == [META, TokenEvent("hi")]  # from the second replica, once
    assert len(handle.keys) == 2 and handle.keys[0] == handle.keys[1]  # same document set


async def test_a_replica_dead_mid_answer_ends_the_stream_with_a_503_event():
    backend, _ = backend_for(FakeStream([Admission(True, "a"), [META, TokenEvent("hi")]], DIED))
    job = make_job()
    items = await run(backend, job)
    assert items[:2] == [META, TokenEvent("hi")]
    assert isinstance(items[2], JobFailure) and items[2].status == 503
    assert items[2].code == "replica_failed" and job.outcome == "error"


async def test_a_full_replica_is_a_429_and_no_replica_a_503():
    backend, _ = backend_for(FakeStream([Admission(False, "a", 429, 7)]))
    with pytest.raises(QueueFullError) as refused:
        await backend.admit(make_job())
    assert refused.value.retry_after_s == 7
    waiting = FakeStream([], hang=True)
    backend, _ = backend_for(waiting, admit_timeout_s=0.05)
    with pytest.raises(WorkerStoppedError):
        await backend.admit(make_job())
    assert waiting.cancelled


async def test_cancelling_the_job_cancels_the_streaming_call():
    stream = FakeStream([Admission(True, "a"), [META]], hang=True)
    backend, _ = backend_for(stream)
    job = make_job()
    await backend.admit(job)
    first = await job.events.get()
    assert first == META and backend.answering == 1
    job.cancel()
    assert [item async for item in job.stream()] == []
    assert stream.cancelled and job.outcome == "cancelled" and not backend.busy


async def test_a_stream_that_ends_without_an_answer_is_a_503_event():
    backend, _ = backend_for(FakeStream([Admission(True, "a"), [META]]))
    job = make_job()
    items = await run(backend, job)
    assert items[0] == META and items[-1].status == 503 and job.outcome == "error"
