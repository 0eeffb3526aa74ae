"""Every way in behaves the same: the same request through the Python API, the CLI, the
server's native and OpenAI routes and LangChain (in-process and against the server) gives
the same answer and the same statistics, each entrance building its defaults from the one
engine configuration (here: the environment's answer length and press)."""

from __future__ import annotations

import json

import pytest

from ragsnap.prompt.documents import Document
from tests.local_client import LocalClient
from tests.tiny_models import tiny_engine

QUESTION = "t5 t9 t12 t3"
DOCS = [
    {"id": "a", "title": "t7", "text": "t4 t8 t15 t16 t23 t42 t4 t8 t15 t16"},
    {"id": "b", "title": "t9", "text": "t12 t3 t5 t9 t30 t31 t32 t33 t12 t3"},
]
# what the statistics of one answer must agree on (timings differ run to run)
SAME = (
    "press",
    "budget",
    "prompt_tokens",
    "kept_tokens",
    "new_tokens",
    "finish_reason",
    "citations_mode",
    "prefill_path",
    "kv_bytes_full",
    "kv_bytes_kept",
)


@pytest.fixture
def configured_tiny(monkeypatch):
    """A tiny engine whose configuration (and every entrance's) says: 9 new tokens, SnapKV."""
    monkeypatch.setenv("RAGSNAP_DEFAULT_MAX_NEW_TOKENS", "9")
    monkeypatch.setenv("RAGSNAP_DEFAULT_PRESS", "snapkv")
    engine = tiny_engine("llama", "sdpa", seed=3)
    engine.runtime.stop_ids.clear()  # random weights: every answer runs to its length
    return engine


def _through_the_cli(engine, monkeypatch, capsys, tmp_path) -> tuple[str, dict]:
    from ragsnap.cli import main
    from ragsnap.engine.engine import RagSnapEngine

    monkeypatch.setattr(RagSnapEngine, "from_config", classmethod(lambda cls, *a, **k: engine))
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps(d) for d in DOCS), encoding="utf-8")
    argv = ["ask", "-q", QUESTION, "--docs", str(path), "--json", "--cache", "none"]
    assert main(argv) == 0
    payload = json.loads(capsys.readouterr().out)
    return payload["answer"], payload["stats"]


def test_the_same_request_gives_the_same_answer_and_statistics_everywhere(
    configured_tiny, monkeypatch, capsys, tmp_path
):
    from ragsnap.api.app import create_app
    from ragsnap.api.local_server import running_server
    from ragsnap.api.settings import Settings
    from ragsnap.integrations.langchain import ChatRagSnap

    engine = configured_tiny
    documents = [Document(**d) for d in DOCS]
    results: dict[str, tuple[str, dict]] = {}
    done = engine.answer(QUESTION, documents)
    results["python"] = (done.answer, done.stats.to_dict())
    results["cli"] = _through_the_cli(engine, monkeypatch, capsys, tmp_path)
    local = ChatRagSnap(engine=engine).invoke(QUESTION, documents=documents)
    results["langchain"] = (local.content, local.response_metadata["ragsnap"])
    app = create_app(Settings(cache_url="none"), engine=engine)
    with LocalClient(app) as client:
        native = client.post("/v1/answer", json={"question": QUESTION, "documents": DOCS})
        chat = client.post(
            "/v1/chat/completions",
            json={
                "model": "ragsnap",
                "messages": [{"role": "user", "content": QUESTION}],
                "documents": DOCS,
            },
        )
    results["native"] = (native.json()["answer"], native.json()["stats"])
    reply = chat.json()
    results["openai"] = (reply["choices"][0]["message"]["content"], reply["ragsnap"])
    with running_server(create_app(Settings(cache_url="none"), engine=engine)) as url:
        remote = ChatRagSnap(base_url=url).invoke(QUESTION, documents=documents)
    results["remote"] = (remote.content, remote.response_metadata["ragsnap"])

    answer, stats = results["python"]
    assert len(answer.split()) >= 3 and stats["new_tokens"] == 9  # the configured length
    assert stats["press"] == "snapkv"  # the configured press
    for where, (other_answer, other_stats) in results.items():
        assert other_answer == answer, where
        assert set(stats) <= set(other_stats), (where, set(stats) - set(other_stats))
        assert {k: other_stats[k] for k in SAME} == {k: stats[k] for k in SAME}, where
