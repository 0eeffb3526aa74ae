"""Continuous batching: requests join, leave and get exactly their batch-1 answers."""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest

from ragsnap.compression import make_press
from ragsnap.engine.engine import AnswerOptions
from ragsnap.engine.events import DoneEvent, MetaEvent, TokenEvent
from ragsnap.engine.scheduler import Scheduler
from ragsnap.prompt.documents import Document
from ragsnap.runtime.generation import GenerationConfig
from tests.api_helpers import DOCS, FAST, parse_sse, running_server
from tests.tiny_models import tiny_engine


def words(start: int, count: int) -> str:
    return " ".join(f"t{2 + (start + i) % 90}" for i in range(count))


@dataclass
class Collector:
    """A request that records what the scheduler sends it."""

    question: str
    documents: list[Document]
    options: AnswerOptions
    namespace: str = "default"
    events: list = field(default_factory=list)
    outcome: str | None = None
    error: Exception | None = None
    cancel_after: int | None = None
    closed: threading.Event = field(default_factory=threading.Event)

    def is_cancelled(self) -> bool:
        tokens = sum(isinstance(e, TokenEvent) for e in self.events)
        return self.cancel_after is not None and tokens >= self.cancel_after

    def started(self) -> None:
        pass

    def emit(self, event) -> None:
        self.events.append(event)

    def fail(self, error: Exception) -> None:
        self.error = error
        self.close("error")

    def close(self, outcome: str) -> None:
        self.outcome = outcome
        self.closed.set()

    @property
    def done(self) -> DoneEvent:
        return next(e for e in self.events if isinstance(e, DoneEvent))


def requests_for_tiny_engine() -> list[Collector]:
    presses = [
        make_press("ragsnap", budget=24, window=8),
        make_press("snapkv", budget=40, window=8),
        make_press("full"),
        make_press("pyramidkv", budget=30, window=8),
    ]
    out = []
    for i, press in enumerate(presses):
        docs = [Document(id=f"d{i}", title="t3", text=words(7 * i, 60 + 25 * i))]
        generation = GenerationConfig(max_new_tokens=6 + 3 * i)
        out.append(Collector(words(50 + i, 4), docs, AnswerOptions(press, generation)))
    return out


@pytest.fixture(scope="module")
def engine_tiny():
    engine = tiny_engine("llama")
    engine.runtime.stop_ids.clear()  # random weights: decode to the length limit
    return engine


def record_joins(requests: dict) -> list:
    """The names of ``requests`` (name -> Collector) in the order their rows join the batch
    (their meta event: the prefill is done)."""
    joined: list = []
    for name, r in requests.items():
        emit = r.emit

        def recording(event, name=name, emit=emit) -> None:
            if isinstance(event, MetaEvent):
                joined.append(name)
            emit(event)

        r.emit = recording  # type: ignore[method-assign]
    return joined


def run(engine, requests, max_batch=8, step_tokens=48):
    # idle_chunk: the tiny prompts prefill in several chunks even with nothing decoding
    scheduler = Scheduler(engine, max_batch=max_batch, step_tokens=step_tokens, idle_chunk=32)
    scheduler.start()
    for r in requests:
        scheduler.submit(r)
    for r in requests:
        assert r.closed.wait(60), "request never finished"
    scheduler.stop()
    return scheduler


def test_batched_answers_equal_serial_answers_and_requests_interleave(engine_tiny) -> None:
    serial = requests_for_tiny_engine()
    run(engine_tiny, serial, max_batch=1)
    batched = requests_for_tiny_engine()
    scheduler = run(engine_tiny, batched, max_batch=8)
    assert [r.done.answer for r in batched] == [r.done.answer for r in serial]
    assert all(r.outcome == "ok" for r in batched)
    assert [r.done.stats.new_tokens for r in batched] == [6, 9, 12, 15]
    for r in batched:
        assert isinstance(r.events[0], MetaEvent) and isinstance(r.events[-1], DoneEvent)
    # the longest request kept decoding while the later ones prefilled and joined
    assert scheduler.stats.steps < sum(r.done.stats.new_tokens for r in batched)


def test_a_cancelled_request_leaves_and_the_others_are_unchanged(engine_tiny) -> None:
    alone = requests_for_tiny_engine()
    run(engine_tiny, alone, max_batch=1)
    mixed = requests_for_tiny_engine()
    mixed[2].cancel_after = 2
    run(engine_tiny, mixed)
    assert mixed[2].outcome == "cancelled" and not any(
        isinstance(e, DoneEvent) for e in mixed[2].events
    )
    for i in (0, 1, 3):
        assert mixed[i].done.answer == alone[i].done.answer


def test_a_prefill_cancelled_between_chunks_frees_the_scheduler(engine_tiny) -> None:
    long = requests_for_tiny_engine()[3]
    long.cancel_after = 0  # cancelled from the start: stops at its first chunk boundary
    short = requests_for_tiny_engine()[0]
    run(engine_tiny, [long, short], step_tokens=32)
    assert long.outcome == "cancelled" and short.outcome == "ok"


def test_a_failing_request_does_not_stop_the_others(engine_tiny) -> None:
    bad = Collector("   ", [], AnswerOptions())  # an empty question
    good = requests_for_tiny_engine()[1]
    run(engine_tiny, [bad, good])
    assert bad.outcome == "error" and "question" in str(bad.error)
    assert good.outcome == "ok"


@pytest.mark.model
def test_service_under_concurrent_streaming_clients_answers_or_refuses(engine) -> None:
    from ragsnap.api.app import create_app
    from ragsnap.api.settings import Settings

    settings = Settings(max_queue=3, max_batch=4, step_tokens=128)
    statuses, done, lock = [], [], threading.Lock()

    def client(i: int, url: str) -> None:
        body = {
            "question": ["What causes tides?", "How do bees find flowers?"][i % 2],
            "documents": DOCS,
            "max_new_tokens": 12,
            "compression": FAST,
            "stream": True,
        }
        with httpx.stream("POST", f"{url}/v1/answer", json=body, timeout=300) as response:
            names = (
                [n for n, _ in parse_sse(response.iter_lines())]
                if response.status_code == 200
                else []
            )
            with lock:
                statuses.append(response.status_code)
                done.append(names)

    with running_server(create_app(settings, engine=engine)) as url:
        threads = [threading.Thread(target=client, args=(i, url)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        metrics = httpx.get(f"{url}/metrics").text
    assert len(statuses) == 8 and set(statuses) <= {200, 429}
    assert statuses.count(200) >= 3  # the first, and the three that waited
    for names in done:
        if names:
            assert names[0] == "meta" and names[-1] == "done" and "error" not in names
    steps = float(re.search(r"^ragsnap_decode_batch_size_count (\S+)$", metrics, re.M).group(1))
    rows = float(re.search(r"^ragsnap_decode_batch_size_sum (\S+)$", metrics, re.M).group(1))
    assert rows > steps  # requests really decoded together


def test_prefill_chunks_are_large_only_while_no_stream_waits(engine_tiny, monkeypatch) -> None:
    chunks: list[tuple[int, int | None]] = []
    scheduler = Scheduler(engine_tiny, max_batch=8, step_tokens=48, idle_chunk=512)
    real = engine_tiny.execute

    def recording(planned, chunk=None):
        chunks.append((len(scheduler._running), chunk))
        return real(planned, chunk)

    monkeypatch.setattr(engine_tiny, "execute", recording)
    scheduler.start()
    requests = requests_for_tiny_engine()
    for r in requests:
        scheduler.submit(r)
    for r in requests:
        assert r.closed.wait(60)
    scheduler.stop()
    assert chunks[0] == (0, 512)  # the first prompt: nobody decoding yet
    assert all(chunk == 48 - running for running, chunk in chunks if running)
    assert any(running for running, _ in chunks)


def test_an_answer_being_finished_does_not_hold_up_the_other_rows(engine_tiny, monkeypatch) -> None:
    short, long = requests_for_tiny_engine()[0], requests_for_tiny_engine()[3]
    release = threading.Event()
    real = engine_tiny.finish

    def finish(prepared, row, ttft_s, **kwargs):
        if prepared.question == short.question:  # the short answer's attribution "takes long"
            assert release.wait(60)
        return real(prepared, row, ttft_s, **kwargs)

    monkeypatch.setattr(engine_tiny, "finish", finish)
    scheduler = Scheduler(engine_tiny, max_batch=8, step_tokens=48, idle_chunk=32)
    scheduler.start()
    scheduler.submit(short)
    scheduler.submit(long)
    # the long row decodes to its last token while the short one's finish is still blocked
    deadline = time.monotonic() + 60
    while scheduler.running or not any(isinstance(e, TokenEvent) for e in long.events):
        assert time.monotonic() < deadline, "the long row stopped decoding"
        time.sleep(0.01)
    assert not short.closed.is_set() and not any(isinstance(e, DoneEvent) for e in short.events)
    release.set()
    for r in (short, long):
        assert r.closed.wait(60) and r.outcome == "ok"
        assert isinstance(r.events[-1], DoneEvent)
    scheduler.stop()


def test_a_miss_stores_its_entries_after_its_answer_and_outside_prefills(
    engine_tiny, tmp_path, monkeypatch
) -> None:
    from ragsnap.cache import open_store
    from ragsnap.engine.engine import RagSnapEngine

    # the compressed and prefix entries only (no per-document pieces), every prefix written
    engine = RagSnapEngine(
        engine_tiny.loaded,
        store=open_store(f"file://{tmp_path}"),
        document_cache=False,
        prefix_store="always",
    )
    engine.runtime.stop_ids.clear()
    first, second = requests_for_tiny_engine()[:2]
    second.documents = [Document(id="long", title="t4", text=words(11, 400))]
    blocked, release = threading.Event(), threading.Event()
    scheduler = Scheduler(engine, max_batch=8, step_tokens=8, idle_chunk=32)
    real = engine.execute

    def execute(planned, chunk=None):
        steps = real(planned, chunk)
        if planned.question != second.question:
            return (yield from steps)
        between = False
        while True:
            try:
                step = next(steps)
            except StopIteration as finished:
                return finished.value
            yield step  # the first answer decodes between the second prompt's chunks
            if between and not scheduler._running and not blocked.is_set():
                if first.closed.wait(30):
                    blocked.set()  # ... and its close comes while the second still prefills
                    assert release.wait(60)
            between = True

    def entries() -> int:  # compressed and prefix entries (not the document set's marker)
        return sum(1 for p in tmp_path.rglob("*.kv") if p.name.split("-")[0] in ("kv", "prefix"))

    monkeypatch.setattr(engine, "execute", execute)
    scheduler.start()
    scheduler.submit(first)
    scheduler.submit(second)
    assert blocked.wait(60) and first.outcome == "ok"
    time.sleep(0.5)
    assert entries() == 0  # the first answer's compressed and prefix entries wait
    assert scheduler.pending_writes == 1
    release.set()
    assert second.closed.wait(60) and second.outcome == "ok"
    deadline = time.monotonic() + 30
    while entries() < 2:  # the first answer's entries are written once the prefill is over
        assert time.monotonic() < deadline, "the first answer's entries were never written"
        time.sleep(0.05)
    scheduler.stop()  # and the second's by the time the scheduler has stopped
    assert entries() == 4 and scheduler.pending_writes == 0
    assert first.done.stats.cache == second.done.stats.cache == "miss"


def test_prompts_prefill_on_prefill_threads_and_rows_decode_on_the_loops_own(
    engine_tiny, monkeypatch
) -> None:
    import torch

    seen: dict[str, set[int]] = {
        "prefill": set(),
        "decode": set(),
        "riding": set(),
        "finish": set(),
    }
    assert Scheduler(engine_tiny).decode_threads == torch.get_num_threads()  # by default
    scheduler = Scheduler(
        engine_tiny, step_tokens=48, idle_chunk=32, prefill_threads=3, decode_threads=2
    )
    real_prefill, real_step = engine_tiny.runtime.prefill_steps, scheduler.batch.step
    real_finish = engine_tiny.finish

    def finish(*args, **kwargs):
        seen["finish"].add(torch.get_num_threads())
        return real_finish(*args, **kwargs)

    def prefill(*args, **kwargs):
        seen["prefill"].add(torch.get_num_threads())
        return real_prefill(*args, **kwargs)

    def step(chunk=None, draft=None):  # a step carrying a prefill chunk: the prefill's threads
        seen["decode" if chunk is None else "riding"].add(torch.get_num_threads())
        return real_step(chunk, draft)

    monkeypatch.setattr(engine_tiny.runtime, "prefill_steps", prefill)
    monkeypatch.setattr(scheduler.batch, "step", step)
    monkeypatch.setattr(engine_tiny, "finish", finish)
    before = torch.get_num_threads()
    scheduler.start()
    requests = requests_for_tiny_engine()
    for r in requests:
        scheduler.submit(r)
    for r in requests:
        assert r.closed.wait(60) and r.outcome == "ok"
    scheduler.stop()
    # the finishing thread computes on one thread (one OpenMP team beside the loop's),
    # whatever the loop's counts are while it starts
    assert seen == {"prefill": {3}, "decode": {2}, "riding": {3}, "finish": {1}}
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="prefill_threads"):
        Scheduler(engine_tiny, prefill_threads=0)


def test_prefix_hits_waiting_together_are_finished_together(engine_tiny, tmp_path, monkeypatch):
    import shutil

    from ragsnap.cache import open_store
    from ragsnap.engine.engine import RagSnapEngine

    def engine_on(folder):
        store = open_store(f"file://{folder}")
        engine = RagSnapEngine(engine_tiny.loaded, store=store, prefix_store="always")
        engine.runtime.stop_ids.clear()
        return engine

    run(engine_on(tmp_path / "kv"), requests_for_tiny_engine())  # stores each document prefix
    shutil.copytree(tmp_path / "kv", tmp_path / "kv-serial")
    shutil.copytree(tmp_path / "kv", tmp_path / "kv-mixed")

    def new_questions(miss_at=None):
        requests = requests_for_tiny_engine()
        for i, r in enumerate(requests):
            r.question = words(80 + i, 5)
        if miss_at is not None:  # documents never seen: a miss between the prefix hits
            unseen = Document(id="new", title="t9", text=words(33, 70))
            requests.insert(miss_at, Collector(words(3, 4), [unseen], requests[0].options))
        return requests

    def answered(folder, max_batch, miss_at=None, stagger_s=None, gather_s=0.05):
        engine, groups, gathered = engine_on(folder), [], []
        real = engine.finish_prefix_hits
        monkeypatch.setattr(
            engine,
            "finish_prefix_hits",
            lambda pending: groups.append(len(pending)) or real(pending),
        )
        scheduler = Scheduler(
            engine, max_batch=max_batch, step_tokens=48, idle_chunk=32, gather_s=gather_s
        )
        scheduler.stats.on_group = lambda size, waited: gathered.append(waited)
        requests = new_questions(miss_at)
        if stagger_s is None:
            for r in requests:  # all waiting before the loop starts
                scheduler.submit(r)
            scheduler.start()
        else:  # arriving one by one at a running loop
            scheduler.start()
            for r in requests:
                scheduler.submit(r)
                time.sleep(stagger_s)
        for r in requests:
            assert r.closed.wait(60) and r.outcome == "ok"
        scheduler.stop()
        return requests, groups, gathered

    shutil.copytree(tmp_path / "kv", tmp_path / "kv-staggered")
    together, groups, _ = answered(tmp_path / "kv", 8)
    alone, serial_groups, _ = answered(tmp_path / "kv-serial", 1)
    hits = [r.done.stats.cache == "prefix-hit" for r in together]
    assert hits == [r.done.stats.cache == "prefix-hit" for r in alone] and sum(hits) >= 2
    assert groups[0] == sum(hits) and serial_groups == [1] * sum(hits)
    assert [r.done.answer for r in together] == [r.done.answer for r in alone]
    # a miss stops the scan: it prefills in its turn, and the hits behind it go together
    mixed, groups, _ = answered(tmp_path / "kv-mixed", 8, miss_at=2)
    assert [r.done.stats.cache for r in mixed] == ["prefix-hit"] * 2 + ["miss"] + ["prefix-hit"] * 2
    assert groups == [2, 2]
    assert [r.done.answer for r in mixed[:2] + mixed[3:]] == [r.done.answer for r in alone]
    # requests sent one after the other: the first hit waits for the rest, while they come
    staggered, groups, waited = answered(tmp_path / "kv-staggered", 8, stagger_s=0.1, gather_s=0.4)
    assert groups == [sum(hits)] and waited[0] >= 0.1 * (sum(hits) - 1)
    assert [r.done.answer for r in staggered] == [r.done.answer for r in alone]


def test_a_greedy_answer_s_first_token_goes_out_before_its_press_compresses(
    engine_tiny, tmp_path, monkeypatch
) -> None:
    """A greedy answer's first token is sent once its prompt's last logits exist, before the
    lookahead draft and the compression (a miss, and prefix hits finished together), after
    a meta event whose kept tokens are not known yet; the answers are those of the
    in-process path, which sends no token early. A sampled answer waits for its row."""
    from ragsnap.cache import open_store
    from ragsnap.engine.engine import RagSnapEngine
    from ragsnap.runtime.generation import GenerationConfig

    engine = RagSnapEngine(
        engine_tiny.loaded, store=open_store(f"file://{tmp_path}"), prefix_store="always"
    )
    engine.runtime.stop_ids.clear()
    log: list[tuple[str, str]] = []

    def logged(real):
        def run(*args, **kwargs):
            result = yield from real(*args, **kwargs)
            log.append(("computed", ""))
            return result

        return run

    monkeypatch.setattr(engine, "execute", logged(engine.execute))
    monkeypatch.setattr(engine, "finish_prefix_hits", logged(engine.finish_prefix_hits))
    press = make_press("ragsnap-lookahead", budget=24, window=8)
    docs = [[Document(id=f"d{i}", title="t3", text=words(9 * i, 90))] for i in range(3)]

    def asked(question: str, documents, generation: GenerationConfig | None = None) -> Collector:
        options = AnswerOptions(press, generation or GenerationConfig(5))
        request = Collector(question, documents, options)
        emit = request.emit

        def recording(event) -> None:
            log.append((type(event).__name__, question))
            emit(event)

        request.emit = recording  # type: ignore[method-assign]
        return request

    def answered(requests) -> list[Collector]:
        log.clear()
        scheduler = Scheduler(engine, max_batch=8, step_tokens=48, idle_chunk=32)
        for r in requests:
            scheduler.submit(r)
        scheduler.start()
        for r in requests:
            assert r.closed.wait(60) and r.outcome == "ok", r.error
        scheduler.stop()
        return requests

    misses = answered([asked(words(50 + i, 4), d) for i, d in enumerate(docs)])
    assert [r.done.stats.cache for r in misses] == ["miss"] * 3
    first = log[:3]  # the first miss: its meta and first token come before its compression
    assert first == [
        ("MetaEvent", misses[0].question),
        ("TokenEvent", misses[0].question),
        ("computed", ""),
    ]
    hits = answered([asked(words(70 + i, 4), d) for i, d in enumerate(docs)])
    assert [r.done.stats.cache for r in hits] == ["prefix-hit"] * 3
    # the group's first tokens, every one, before the group's draft and compression end
    assert [kind for kind, _ in log[:7]] == ["MetaEvent", "TokenEvent"] * 3 + ["computed"]
    for r in misses + hits:
        meta = next(e for e in r.events if isinstance(e, MetaEvent))
        assert meta.kept_tokens is None and r.done.stats.kept_tokens > 0
        alone = engine.answer(r.question, r.documents, r.options)
        assert r.done.answer == alone.answer and r.done.stats.new_tokens == 5
    sampled = answered([asked(words(90, 4), docs[0], GenerationConfig(5, temperature=0.8))])
    meta = next(e for e in sampled[0].events if isinstance(e, MetaEvent))
    assert meta.kept_tokens is not None and log.index(("computed", "")) == 0
    # in-process (engine.stream) the same: a new question's first token, then the rest
    log.clear()
    streamed = []
    for event in engine.stream(words(95, 4), docs[1], AnswerOptions(press, GenerationConfig(5))):
        log.append((type(event).__name__, ""))
        streamed.append(event)
    assert [kind for kind, _ in log[:3]] == ["MetaEvent", "TokenEvent", "computed"]
    assert streamed[-1].stats.cache == "prefix-hit" and streamed[-1].stats.new_tokens == 5
    assert "".join(e.text for e in streamed if isinstance(e, TokenEvent)) == streamed[-1].answer


def test_a_short_prompt_goes_first_behind_a_long_one_and_the_long_one_still_ends(
    engine_tiny,
) -> None:
    press = make_press("snapkv", budget=24, window=8)

    def request(start: int, count: int) -> Collector:
        docs = [Document(id=f"d{start}", title="t3", text=words(start, count))]
        return Collector(words(start + 1, 4), docs, AnswerOptions(press, GenerationConfig(4)))

    long, middle, shorts = request(0, 700), request(5, 400), [request(9 + i, 40) for i in range(3)]
    order = record_joins(dict(enumerate((long, middle, *shorts))))
    scheduler = Scheduler(engine_tiny, max_batch=8, step_tokens=48, idle_chunk=32)
    everyone = (long, middle, *shorts)
    for r in everyone:  # all waiting when the long one, first in line, starts
        scheduler.submit(r)
    scheduler.start()
    for r in everyone:
        assert r.closed.wait(120), "request never finished"
    scheduler.stop()
    assert [r.outcome for r in everyone] == ["ok"] * 5, [r.error for r in everyone]
    # the short ones overtake the long prompt; the middle one (over half of what the long one
    # had left) waits for it at the head of the queue, its lookup kept, and is not re-asked
    assert set(order[:3]) == {2, 3, 4} and order[3:] == [0, 1]
    serial = [Collector(r.question, r.documents, r.options) for r in everyone]
    run(engine_tiny, serial, max_batch=1)
    assert [r.done.answer for r in everyone] == [r.done.answer for r in serial]


def test_a_prompt_that_goes_first_starts_beside_the_long_one_not_inside_it(
    engine_tiny, monkeypatch
) -> None:
    """The scheduler only decides: a short prompt that overtakes a long one starts while the
    long one's execution is suspended between two chunks (never from inside it), and each
    execution's chunks are taken one per scheduler step."""
    press = make_press("snapkv", budget=24, window=8)
    long = Collector(
        words(1, 4),
        [Document(id="l", title="t3", text=words(0, 600))],
        AnswerOptions(press, GenerationConfig(4)),
    )
    short = Collector(
        words(9, 4),
        [Document(id="s", title="t3", text=words(9, 30))],
        AnswerOptions(press, GenerationConfig(4)),
    )
    started: list = []
    nested: list[bool] = []
    joined = record_joins({"long": long, "short": short})
    real = engine_tiny.execute

    def execute(planned, chunk=None):
        nested.append(any(g.gi_running for g in started))
        steps = real(planned, chunk)
        started.append(steps)
        return steps

    monkeypatch.setattr(engine_tiny, "execute", execute)
    scheduler = Scheduler(engine_tiny, max_batch=8, step_tokens=48, idle_chunk=32)
    scheduler.submit(long)
    scheduler.start()
    deadline = time.monotonic() + 60
    while not started:  # the long prompt is prefilling
        assert time.monotonic() < deadline
        time.sleep(0.001)
    scheduler.submit(short)
    for r in (long, short):
        assert r.closed.wait(120) and r.outcome == "ok"
    scheduler.stop()
    assert len(started) == 2 and nested == [False, False]
    assert joined == ["short", "long"]  # it went first


def test_a_request_looked_up_between_chunks_still_counts_as_waiting(
    engine_tiny, monkeypatch
) -> None:
    """While the requests behind a long prompt are looked up between two of its chunks,
    they stay in the queue's count, so a full queue keeps refusing (the server's 429)."""
    press = make_press("snapkv", budget=24, window=8)
    long = Collector(
        words(1, 4),
        [Document(id="l", title="t3", text=words(0, 600))],
        AnswerOptions(press, GenerationConfig(4)),
    )
    behind = [
        Collector(
            words(9 + i, 4),
            [Document(id=f"s{i}", title="t3", text=words(9 + i, 30 + 300 * i))],
            AnswerOptions(press, GenerationConfig(4)),
        )
        for i in range(2)
    ]
    scheduler = Scheduler(engine_tiny, max_batch=8, step_tokens=48, idle_chunk=32)
    seen: dict[str, list[int]] = {}
    real = engine_tiny.lookup

    def lookup(question, documents, options, namespace):
        seen.setdefault(question, []).append(len(scheduler.waiting()))
        return real(question, documents, options, namespace)

    monkeypatch.setattr(engine_tiny, "lookup", lookup)
    for r in (long, *behind):
        scheduler.submit(r)
    scheduler.start()
    for r in (long, *behind):
        assert r.closed.wait(120) and r.outcome == "ok", r.error
    scheduler.stop()
    # looked up between the long prompt's chunks: itself and the one behind it still wait;
    # the second (too long to go first) kept its place and its lookup, and is not re-asked
    assert seen[behind[0].question] == [2] and seen[behind[1].question] == [1]


def test_admission_by_kv_memory_bounds_what_runs_and_refuses_what_never_fits(engine_tiny):
    from ragsnap.errors import KVMemoryError

    per_token = engine_tiny.runtime.kv_bytes_per_token()
    assert per_token == 2 * 4 * 2 * 16 * 4  # K and V, 4 layers, 2 KV heads, 16 dims, float32
    probe = Scheduler(engine_tiny)
    needs = [
        probe.kv_need(r, engine_tiny.lookup(r.question, r.documents, r.options, "default"))
        for r in requests_for_tiny_engine()
    ]

    def serve(budget: int | None, extra: list[Collector]) -> tuple[list, list[tuple[int, int]]]:
        scheduler = Scheduler(
            engine_tiny, max_batch=8, step_tokens=48, idle_chunk=32, kv_memory_bytes=budget
        )
        seen: list[tuple[int, int]] = []  # (KV bytes in use, rows) at every decode step
        step = scheduler.batch.step

        def recording(chunk=None, draft=None):
            seen.append((scheduler.kv_bytes_in_use(), len(scheduler._running)))
            return step(chunk, draft)

        scheduler.batch.step = recording  # type: ignore[method-assign]
        requests = [*requests_for_tiny_engine(), *extra]
        scheduler.start()
        for r in requests:
            scheduler.submit(r)
        for r in requests:
            assert r.closed.wait(60)
        scheduler.stop()
        assert scheduler.kv_bytes_in_use() == 0
        return requests, seen

    free, free_seen = serve(None, [])
    budget = max(needs)  # the largest request alone fits
    huge = Collector("t5 t6", [Document(id="big", title="t3", text=words(0, 400))], free[0].options)
    bounded, seen = serve(budget, [huge])
    assert isinstance(huge.error, KVMemoryError) and "RAGSNAP_KV_MEMORY_GIB" in str(huge.error)
    assert max(used for used, _ in seen) <= budget < max(used for used, _ in free_seen)
    assert max(rows for _, rows in seen) < max(rows for _, rows in free_seen)  # memory bound it
    assert [r.done.answer for r in bounded[:-1]] == [r.done.answer for r in free]


def test_the_in_memory_tiers_live_inside_the_kv_memory(engine_tiny, tmp_path):
    from ragsnap.cache import open_store
    from ragsnap.engine.engine import RagSnapEngine
    from ragsnap.engine.scheduler import TIER_SHARE

    def engine_on(folder):
        engine = RagSnapEngine(engine_tiny.loaded, store=open_store(f"file://{folder}"))
        engine.runtime.stop_ids.clear()
        return engine

    free_engine = engine_on(tmp_path / "free")
    tiers = free_engine.tiers
    bounds = [tier.max_bytes for tier in (tiers.memory, tiers.unwritten, tiers.hits)]
    free = Scheduler(free_engine)
    assert free.tier_memory_bytes == 0 and free.request_memory_bytes is None
    assert [t.max_bytes for t in (tiers.memory, tiers.unwritten, tiers.hits)] == bounds

    probe = Scheduler(engine_tiny)
    needs = [
        probe.kv_need(r, engine_tiny.lookup(r.question, r.documents, r.options, "default"))
        for r in requests_for_tiny_engine()
    ]
    budget = 8 * max(needs)  # the tiers' quarter holds a few prefixes and entries
    engine = engine_on(tmp_path / "bounded")
    scheduler = Scheduler(
        engine, max_batch=8, step_tokens=48, idle_chunk=32, kv_memory_bytes=budget
    )
    tiers = engine.tiers
    cut = [tier.max_bytes for tier in (tiers.memory, tiers.unwritten, tiers.hits)]
    assert scheduler.tier_memory_bytes == sum(cut) <= TIER_SHARE * budget
    assert scheduler.request_memory_bytes == budget - sum(cut)
    # each tier cut in proportion to its own bound
    assert [c * sum(bounds) // sum(cut) for c in cut] == pytest.approx(bounds, rel=1e-3)

    held: list[tuple[int, int]] = []  # (requests' KV, tiers') at every decode step
    step = scheduler.batch.step

    def recording(chunk=None, draft=None):
        held.append((scheduler.kv_bytes_in_use(), scheduler.tier_bytes_in_use()))
        return step(chunk, draft)

    scheduler.batch.step = recording  # type: ignore[method-assign]
    scheduler.start()
    rounds = []
    for _ in range(2):  # the second round is served from the tiers
        requests = requests_for_tiny_engine()
        for r in requests:
            scheduler.submit(r)
        for r in requests:
            assert r.closed.wait(60)
        rounds.append(requests)
    scheduler.stop()
    assert max(requests for requests, _ in held) <= scheduler.request_memory_bytes
    assert 0 < max(tier for _, tier in held) <= scheduler.tier_memory_bytes  # used, within
    assert max(requests + tier for requests, tier in held) <= budget
    assert [r.done.answer for r in rounds[1]] == [r.done.answer for r in rounds[0]]

    def cache(request):
        return next(e.cache for e in request.events if isinstance(e, MetaEvent))

    assert {cache(r) for r in rounds[0]} == {"miss"} and "hit" in {cache(r) for r in rounds[1]}


def test_prefix_hits_reserved_for_are_as_many_as_the_kv_memory_holds(engine_tiny):
    per_token = engine_tiny.runtime.kv_bytes_per_token()
    assert Scheduler(engine_tiny, max_batch=64).prefix_hit_rows(3072) == 64  # no bound
    bounded = Scheduler(engine_tiny, max_batch=64, kv_memory_bytes=10 * 3072 * per_token)
    assert bounded.prefix_hit_rows(3072) == 10  # each parks its prefix's full KV
    assert bounded.prefix_hit_rows(100 * 3072) == 1  # at least one
    assert Scheduler(engine_tiny, max_batch=4, kv_memory_bytes=1 << 40).prefix_hit_rows(3072) == 4


def decoding(engine, long: Collector) -> Scheduler:
    """A started scheduler on ``engine`` whose row for ``long`` decodes."""
    scheduler = Scheduler(engine, max_batch=8, step_tokens=48, idle_chunk=32)
    scheduler.start()
    scheduler.submit(long)
    deadline = time.monotonic() + 60
    while not any(isinstance(e, TokenEvent) for e in long.events[1:]):
        assert time.monotonic() < deadline, "the long answer never decoded"
        time.sleep(0.01)
    return scheduler


@pytest.mark.parametrize("arrives_mid_group", [False, True])
def test_prefix_hits_finished_while_rows_decode_draft_in_their_decode_steps(
    engine_tiny, tmp_path, monkeypatch, arrives_mid_group
) -> None:
    """Prefix hits finished while another row decodes run each pass of their lookahead
    draft in that row's decode step (one lean pass for both): the row keeps decoding
    through the group, and every answer is the one it gets alone. Once a request waits,
    the passes left run alone (the group ends sooner and the request is looked up)."""
    import shutil

    from ragsnap.cache import open_store
    from ragsnap.engine.engine import RagSnapEngine
    from ragsnap.runtime.decode import DecodeBatch

    def engine_on(folder):
        store = open_store(f"file://{folder}")
        engine = RagSnapEngine(engine_tiny.loaded, store=store, prefix_store="always")
        engine.runtime.stop_ids.clear()
        return engine

    press = make_press("ragsnap-lookahead", budget=24, window=8)
    docs = [[Document(id=f"d{i}", title="t3", text=words(9 * i, 90))] for i in range(3)]

    def asked(question, documents, tokens):
        return Collector(question, documents, AnswerOptions(press, GenerationConfig(tokens)))

    def requests():
        long = asked(words(5, 4), [Document(id="long", title="t4", text=words(40, 80))], 40)
        return long, [asked(words(60 + i, 5), d, 6) for i, d in enumerate(docs)]

    run(engine_on(tmp_path / "kv"), [asked(words(20 + i, 4), d, 2) for i, d in enumerate(docs)])
    for copy in ("kv-long", "kv-hits"):
        shutil.copytree(tmp_path / "kv", tmp_path / copy)
    long_alone, hits_alone = requests()
    run(engine_on(tmp_path / "kv-long"), [long_alone], max_batch=1)
    for r in hits_alone:
        run(engine_on(tmp_path / "kv-hits"), [r], max_batch=1)
        shutil.rmtree(tmp_path / "kv-hits")  # each a prefix hit, not the others' exact hit
        shutil.copytree(tmp_path / "kv", tmp_path / "kv-hits")

    rides: list[bool] = []
    step = DecodeBatch.step
    late = asked(words(90, 3), [Document(id="late", title="t5", text=words(70, 40))], 2)

    def recording(self, chunk=None, draft=None):
        outputs = step(self, chunk, draft)
        if draft is not None:
            rides.append(draft.logits is not None)
            if arrives_mid_group and len(rides) == 1:
                scheduler.submit(late)
        return outputs

    monkeypatch.setattr(DecodeBatch, "step", recording)
    long, hits = requests()
    scheduler = decoding(engine_on(tmp_path / "kv"), long)
    for r in hits:
        scheduler.submit(r)
    for r in (long, *hits, *([late] if arrives_mid_group else [])):
        assert r.closed.wait(60) and r.outcome == "ok"
    scheduler.stop()
    if arrives_mid_group:
        assert rides == [True]  # after the first pass, the rest ran alone
    else:
        assert len(rides) > 1 and all(rides)  # every pass rode a decode step of the long row
    assert [r.done.stats.cache for r in hits] == ["prefix-hit"] * 3
    assert long.done.answer == long_alone.done.answer
    assert [r.done.answer for r in hits] == [r.done.answer for r in hits_alone]


@pytest.mark.parametrize("cold_press", ["ragsnap-lookahead", "ragsnap-propagate"])
def test_a_cold_prompts_draft_passes_ride_the_running_rows_decode_steps(
    engine_tiny, monkeypatch, cold_press
) -> None:
    """A prompt prefilled while another row decodes runs each pass of its lookahead draft
    in that row's decode step (one lean pass reads the weights for both), and every answer
    is the one it gets alone. A query-aware prefill's draft runs alone: its upper layers
    hold only the propagated tokens, and the lean pass attends by position."""
    from ragsnap.engine.engine import RagSnapEngine
    from ragsnap.runtime.decode import DecodeBatch

    engine = RagSnapEngine(engine_tiny.loaded)
    engine.runtime.stop_ids.clear()  # full drafts, several passes each
    press = make_press("ragsnap-lookahead", budget=24, window=8)

    def requests():
        options = AnswerOptions(press, GenerationConfig(40))
        long = Collector(words(5, 4), [Document(id="long", title="t", text=words(40, 80))], options)
        options = AnswerOptions(make_press(cold_press, budget=24, window=8), GenerationConfig(6))
        cold = Collector(words(60, 5), [Document(id="c", title="t", text=words(9, 90))], options)
        return long, cold

    alone = requests()
    for r in alone:
        run(engine, [r], max_batch=1)

    rides: list[bool] = []
    step = DecodeBatch.step

    def recording(self, chunk=None, draft=None):
        outputs = step(self, chunk, draft)
        if chunk is not None and chunk.queries is not None:  # a draft pass
            rides.append(chunk.logits is not None)
        return outputs

    monkeypatch.setattr(DecodeBatch, "step", recording)
    long, cold = requests()
    scheduler = decoding(engine, long)
    scheduler.submit(cold)
    for r in (long, cold):
        assert r.closed.wait(60) and r.outcome == "ok"
    scheduler.stop()
    if cold_press == "ragsnap-lookahead":  # every pass of the cold draft rode a decode step
        assert len(rides) > 1 and all(rides)
    else:
        assert rides == [] and cold.done.stats.prefill_path == "propagate"
    assert [r.done.answer for r in (long, cold)] == [r.done.answer for r in alone]
