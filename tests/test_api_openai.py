"""The official ``openai`` client against /v1/chat/completions and /v1/models, unchanged."""

from __future__ import annotations

import openai
import pytest

from tests.api_helpers import DOCS, FAST, running_server

KEY = "openai-test-key"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What causes tides?"},
]
EXTRA = {"documents": DOCS, "compression": FAST}


@pytest.fixture(scope="module")
def client(engine):
    from ragsnap.api.app import create_app
    from ragsnap.api.settings import Settings

    with running_server(create_app(Settings(api_keys=KEY), engine=engine)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=300)


def test_models_lists_the_served_model(client):
    ids = [model.id for model in client.models.list()]
    assert "ragsnap" in ids and len(ids) == 2


def test_non_streaming_completion_carries_citations_and_stats(client):
    completion = client.chat.completions.create(
        model="ragsnap", messages=MESSAGES, max_tokens=6, extra_body=EXTRA
    )
    assert completion.object == "chat.completion"
    choice = completion.choices[0]
    assert choice.message.role == "assistant" and choice.message.content.strip()
    assert choice.finish_reason in {"stop", "length"}
    stats = completion.model_extra["ragsnap"]
    assert isinstance(completion.model_extra["citations"], list)
    assert stats["kept_tokens"] == FAST["budget"] < stats["prompt_tokens"]
    assert completion.usage.prompt_tokens == stats["prompt_tokens"]
    assert 1 <= completion.usage.completion_tokens <= 6

    # streaming: role first, text deltas, the last choice chunk holds finish_reason + ragsnap fields
    stream = client.chat.completions.create(
        model="ragsnap",
        messages=MESSAGES,
        max_tokens=6,
        extra_body=EXTRA,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choices = [c for c in chunks if c.choices]
    final = with_choices[-1]
    assert final.choices[0].finish_reason == choice.finish_reason
    assert final.model_extra["citations"] == completion.model_extra["citations"]
    assert final.model_extra["ragsnap"]["kept_tokens"] == stats["kept_tokens"]
    text = "".join(c.choices[0].delta.content or "" for c in with_choices)
    assert text == choice.message.content  # greedy: the same answer both ways
    assert (
        chunks[-1].choices == []
        and chunks[-1].usage.completion_tokens == completion.usage.completion_tokens
    )
    assert sum(1 for c in chunks if c.usage is not None) == 1  # usage counted once
    # citations as OpenAI annotations on the message, and in the choice's logprobs
    assert choice.logprobs.model_extra["ragsnap_citations"] == completion.model_extra["citations"]
    assert choice.logprobs.content is None
    assert [d["id"] for d in completion.model_extra["documents"]] == ["bees", "tides"]
    for note in choice.message.annotations or []:
        span = choice.message.content[note.url_citation.start_index : note.url_citation.end_index]
        assert span.strip() and note.url_citation.url.startswith("ragsnap:doc/")
    cited = {c["doc_id"] for c in completion.model_extra["citations"]}
    urls = {n.url_citation.url for n in choice.message.annotations or []}
    assert urls == {f"ragsnap:doc/{doc_id}" for doc_id in cited}


def test_stop_is_honoured_in_both_modes(client):
    full = client.chat.completions.create(
        model="ragsnap", messages=MESSAGES, max_tokens=6, extra_body=EXTRA
    )
    text = full.choices[0].message.content
    stop = text[2:4]
    cut = client.chat.completions.create(
        model="ragsnap", messages=MESSAGES, max_tokens=6, extra_body=EXTRA, stop=[stop]
    )
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(
        model="ragsnap", messages=MESSAGES, max_tokens=6, extra_body=EXTRA, stop=stop, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == cut.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="ragsnap", messages=MESSAGES, extra_body=EXTRA, stop=["a", "b", "c", "d", "e"]
        )
    assert info.value.body["param"] == "stop"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
        ("tool_choice", "required"),
        ("response_format", {"type": "json_object"}),
        ("logprobs", True),
        ("n", 2),
        ("frequency_penalty", 0.5),
        ("colour", "red"),
    ],
)
def test_unsupported_fields_are_refused_by_name(client, field, value):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="ragsnap", messages=MESSAGES, extra_body={**EXTRA, field: value}
        )
    assert info.value.body["param"] == field


def test_off_values_of_unsupported_fields_are_accepted(client):
    completion = client.chat.completions.create(
        model="ragsnap",
        messages=MESSAGES,
        max_tokens=1,
        n=1,
        user="someone",
        extra_body={**EXTRA, "tool_choice": "none", "response_format": {"type": "text"}},
    )
    assert completion.usage.completion_tokens == 1


def test_client_errors_are_openai_errors(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="ragsnap",
            messages=MESSAGES,
            extra_body={"documents": DOCS, "compression": {"press": "zip"}},
        )
    assert info.value.body["param"] == "compression.press"
    bad_key = openai.OpenAI(base_url=str(client.base_url), api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES, extra_body=EXTRA)


def test_chat_openai_invoke_and_stream_keep_citations_and_count_usage_once(client):
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(
        model="ragsnap",
        base_url=str(client.base_url),
        api_key=KEY,
        max_tokens=6,
        max_retries=0,
        stream_usage=True,
        extra_body=EXTRA,
    )
    message = chat.invoke(MESSAGES)
    citations = message.response_metadata["logprobs"]["ragsnap_citations"]
    assert isinstance(citations, list)
    assert all({"index", "doc_id", "title"} <= set(c) for c in citations)
    chunks = list(chat.stream(MESSAGES))
    merged = chunks[0]
    for piece in chunks[1:]:
        merged = merged + piece
    assert merged.content == message.content
    assert merged.usage_metadata["output_tokens"] == message.usage_metadata["output_tokens"]
    assert merged.usage_metadata["input_tokens"] == message.usage_metadata["input_tokens"]
    assert merged.response_metadata["logprobs"]["ragsnap_citations"] == citations
    # "sources": a Sources: list in the text itself, for clients that keep nothing else
    sourced = ChatOpenAI(
        model="ragsnap",
        base_url=str(client.base_url),
        api_key=KEY,
        max_tokens=6,
        max_retries=0,
        extra_body={**EXTRA, "sources": True},
    ).invoke(MESSAGES)
    assert sourced.content.startswith(message.content)
    if citations:
        assert "\n\nSources:\n[" in sourced.content


def test_a_corpus_server_searches_with_the_conversation(engine, tmp_path):
    from ragsnap.api.app import create_app
    from ragsnap.api.settings import Settings

    (tmp_path / "penicillin.md").write_text("Alexander Fleming discovered penicillin in 1928.")
    (tmp_path / "tides.md").write_text("Tides follow the gravity of the Moon.")
    settings = Settings(corpus_dir=str(tmp_path), default_top_k=1)
    with running_server(create_app(settings, engine=engine)) as url:
        corpus = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        first = [{"role": "user", "content": "Who discovered penicillin?"}]
        one = corpus.chat.completions.create(model="ragsnap", messages=first, max_tokens=2)
        assert [d["id"] for d in one.model_extra["documents"]] == ["penicillin.md#1"]
        follow_up = [
            *first,
            {"role": "assistant", "content": "Alexander Fleming."},
            {"role": "user", "content": "In which year?"},
        ]
        two = corpus.chat.completions.create(model="ragsnap", messages=follow_up, max_tokens=2)
        assert [d["id"] for d in two.model_extra["documents"]] == ["penicillin.md#1"]
        # the earlier turn is in the prompt
        assert two.usage.prompt_tokens > one.usage.prompt_tokens
        nothing = corpus.chat.completions.create(
            model="ragsnap", messages=[{"role": "user", "content": "zzzz qqqq?"}], max_tokens=2
        )
        assert nothing.model_extra["documents"] == []


def test_context_in_a_system_message_becomes_the_documents(client):
    tides, bees = DOCS[1]["text"], DOCS[0]["text"]
    from_messages = client.chat.completions.create(
        model="ragsnap",
        messages=[
            {"role": "system", "content": f"{tides}\n\n{bees}"},
            {"role": "user", "content": "What causes tides?"},
        ],
        max_tokens=1,
        extra_body={"compression": FAST, "document_order": "given"},
    )
    given = client.chat.completions.create(
        model="ragsnap",
        messages=[{"role": "user", "content": "What causes tides?"}],
        max_tokens=1,
        extra_body={
            "compression": FAST,
            "document_order": "given",
            "documents": [{"id": "1", "text": tides}, {"id": "2", "text": bees}],
        },
    )
    assert [d["id"] for d in from_messages.model_extra["documents"]] == ["1", "2"]
    # the same prompt: the system text became the documents, not instructions as well
    assert from_messages.usage.prompt_tokens == given.usage.prompt_tokens
    # no documents anywhere: an answer over none (tests/test_api_schema_rules.py)
    bare = client.chat.completions.create(
        model="ragsnap", messages=[{"role": "user", "content": "Why?"}], max_tokens=1
    )
    assert bare.model_extra["documents"] == [] and bare.model_extra["citations"] == []
