"""The verdict (issue 43) on every route, on a tiny random model: its answer is words no
document holds, so it is not grounded. With ``flag`` the streamed tokens are the model's
and the answer stays; with ``abstain`` the final answer is the abstention text, the
tokens already streamed stay the model's and ``model_answer`` keeps them."""

from __future__ import annotations

import json

import pytest

from ragsnap.citations.options import ABSTAIN_TEXT, CitationOptions
from ragsnap.engine.engine import AnswerOptions
from ragsnap.engine.events import DoneEvent, TokenEvent
from ragsnap.prompt.documents import Document
from ragsnap.runtime.generation import GenerationConfig
from tests.api_helpers import parse_sse
from tests.local_client import LocalClient
from tests.tiny_models import tiny_engine

QUESTION = "What causes the tides?"
DOCS = [{"id": "tides", "title": "Tides", "text": "The Moon's gravity causes the tides."}]
BODY = {"question": QUESTION, "documents": DOCS, "max_new_tokens": 6}


@pytest.fixture(scope="module")
def tiny():
    return tiny_engine("llama", "sdpa", seed=4)


def _client(tiny, **settings):
    from ragsnap.api.app import create_app
    from ragsnap.api.settings import Settings

    return LocalClient(create_app(Settings(cache_url="none", **settings), engine=tiny))


def _stream(tiny, unsupported: str) -> tuple[str, DoneEvent]:
    options = AnswerOptions(
        generation=GenerationConfig(max_new_tokens=6),
        citations=CitationOptions(unsupported=unsupported),
    )
    documents = [Document(**d) for d in DOCS]
    events = list(tiny.stream(QUESTION, documents, options))
    tokens = "".join(e.text for e in events if isinstance(e, TokenEvent))
    done = events[-1]
    assert isinstance(done, DoneEvent)
    return tokens, done


def test_the_engine_flags_or_abstains_and_the_streamed_tokens_stay_the_model_s(tiny):
    tokens, flagged = _stream(tiny, "flag")
    assert tokens.strip() and flagged.answer == tokens
    assert flagged.grounded is False and flagged.grounded_score == 0.0
    assert flagged.model_answer is None and flagged.unsupported_sentences
    same, abstained = _stream(tiny, "abstain")
    assert same == tokens  # byte for byte the model's
    assert abstained.answer == ABSTAIN_TEXT and abstained.model_answer == tokens
    assert abstained.grounded is False


def test_native_api_json_and_events_carry_the_verdict(tiny):
    with _client(tiny) as client:
        flagged = client.post("/v1/answer", json=BODY).json()
        abstained = client.post("/v1/answer", json={**BODY, "unsupported": "abstain"}).json()
        with client.stream(
            "POST", "/v1/answer", json={**BODY, "stream": True, "unsupported": "abstain"}
        ) as response:
            events = list(parse_sse(response.iter_lines()))
        bad = client.post("/v1/answer", json={**BODY, "unsupported": "hide"})
    assert flagged["grounded"] is False and flagged["grounded_score"] == 0.0
    assert flagged["model_answer"] is None and flagged["answer"].strip()
    assert flagged["unsupported_sentences"] and all(
        c["supported"] is False for c in flagged["citations"]
    )
    assert abstained["answer"] == ABSTAIN_TEXT
    assert abstained["model_answer"] == flagged["answer"]
    tokens = "".join(data["text"] for name, data in events if name == "token")
    assert events[-1][0] == "done" and tokens == flagged["answer"]
    done = events[-1][1]
    assert done["answer"] == ABSTAIN_TEXT and done["model_answer"] == tokens
    assert done["grounded"] is False and done["grounded_score"] == 0.0
    assert bad.status_code == 422 and "unsupported" in bad.text


def test_the_server_default_comes_from_its_settings_and_the_environment(tiny, monkeypatch):
    monkeypatch.setenv("RAGSNAP_UNSUPPORTED", "abstain")
    monkeypatch.setenv("RAGSNAP_ABSTAIN_TEXT", "Not in these documents.")
    with _client(tiny) as client:
        default = client.post("/v1/answer", json=BODY).json()
        flagged = client.post("/v1/answer", json={**BODY, "unsupported": "flag"}).json()
    assert default["answer"] == "Not in these documents." and default["model_answer"]
    assert flagged["answer"] == default["model_answer"] and flagged["model_answer"] is None


def test_openai_route_carries_the_verdict_in_its_ragsnap_fields(tiny):
    body = {
        "model": "ragsnap",
        "messages": [{"role": "user", "content": QUESTION}],
        "documents": DOCS,
        "max_tokens": 6,
    }
    with _client(tiny) as client:
        flagged = client.post("/v1/chat/completions", json=body).json()
        abstained = client.post(
            "/v1/chat/completions", json={**body, "unsupported": "abstain"}
        ).json()
        with client.stream(
            "POST", "/v1/chat/completions", json={**body, "stream": True, "unsupported": "abstain"}
        ) as response:
            chunks = [data for _, data in parse_sse(response.iter_lines()) if data != "[DONE]"]
    answer = flagged["choices"][0]["message"]["content"]
    assert flagged["ragsnap"]["grounded"] is False and flagged["ragsnap"]["model_answer"] is None
    assert flagged["ragsnap"]["grounded_score"] == 0.0
    message = abstained["choices"][0]["message"]
    assert message["content"] == ABSTAIN_TEXT and message["annotations"] == []
    assert abstained["ragsnap"]["model_answer"] == answer
    streamed = "".join(
        c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]
    )
    assert streamed == answer  # the model's tokens, untouched
    final = chunks[-1]["ragsnap"]
    assert final["grounded"] is False and final["answer"] == ABSTAIN_TEXT
    assert final["model_answer"] == answer


def test_langchain_in_process_and_against_a_server_carry_the_verdict(tiny):
    from ragsnap.api.app import create_app
    from ragsnap.api.local_server import running_server
    from ragsnap.api.settings import Settings
    from ragsnap.integrations.langchain import ChatRagSnap

    documents = [Document(**d) for d in DOCS]
    local = ChatRagSnap(engine=tiny, max_new_tokens=6)
    flagged = local.invoke(QUESTION, documents=documents)
    assert flagged.response_metadata["grounded"] is False
    assert flagged.response_metadata["grounded_score"] == 0.0
    abstaining = ChatRagSnap(engine=tiny, max_new_tokens=6, unsupported="abstain")
    replaced = abstaining.invoke(QUESTION, documents=documents)
    assert replaced.content == ABSTAIN_TEXT
    assert replaced.response_metadata["model_answer"] == flagged.content
    chunks = list(abstaining.stream(QUESTION, documents=documents))
    assert "".join(c.content for c in chunks) == flagged.content  # streamed: the model's
    assert chunks[-1].response_metadata["answer"] == ABSTAIN_TEXT
    with running_server(create_app(Settings(cache_url="none"), engine=tiny)) as url:
        remote = ChatRagSnap(base_url=url, max_new_tokens=6, unsupported="abstain")
        answered = remote.invoke(QUESTION, documents=documents)
    assert answered.content == ABSTAIN_TEXT
    assert answered.response_metadata["grounded"] is False
    assert answered.response_metadata["model_answer"] == flagged.content


def test_ask_json_and_summary_carry_the_verdict(tiny, tmp_path, capsys, monkeypatch):
    from ragsnap.cli import main
    from ragsnap.engine.engine import RagSnapEngine

    def from_config(cls, config, **_options):  # the tiny engine, with the command's settings
        monkeypatch.setattr(tiny, "config", config)
        return tiny

    monkeypatch.setattr(RagSnapEngine, "from_config", classmethod(from_config))
    path = tmp_path / "tides.txt"
    path.write_text(DOCS[0]["text"], encoding="utf-8")
    argv = ["ask", "-q", QUESTION, "--docs", str(path), "--max-new-tokens", "6", "--cache", "none"]
    assert main([*argv, "--json", "--unsupported", "abstain"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["grounded"] is False and payload["grounded_score"] == 0.0, payload
    assert payload["answer"] == ABSTAIN_TEXT and payload["model_answer"].strip()
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith(payload["model_answer"])  # streamed as the model wrote it
    assert "grounded: no (score 0.00)" in out and "abstained" not in out
