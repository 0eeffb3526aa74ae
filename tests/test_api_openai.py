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
    from api.app import create_app
    from api.settings import Settings

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
