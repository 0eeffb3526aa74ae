"""The rules the served schema used to let through and the server then refused (issue 55),
each now stated in the schema or given a meaning: a budget below the window, a decode window
over its slack, an id given twice, a query no passage matches, a chat with no documents or
with an empty user message. Through the real app on the embedded model, short answers."""

from __future__ import annotations

import pytest

from tests.api_helpers import DOCS, FAST, fast_settings
from tests.local_client import LocalClient

pytestmark = pytest.mark.model

QUESTION = "What causes tides?"


def _settings(**extra):
    return fast_settings(max_new_tokens_limit=8, **extra)


@pytest.fixture(scope="module")
def client(engine):
    from ragsnap.api.app import create_app

    with LocalClient(create_app(_settings(), engine=engine)) as test_client:
        yield test_client


@pytest.fixture(scope="module")
def corpus_client(engine, tmp_path_factory):
    from ragsnap.api.app import create_app

    corpus = tmp_path_factory.mktemp("corpus")
    (corpus / "tides.md").write_text("Tides are caused mostly by the gravity of the Moon.\n")
    with LocalClient(create_app(_settings(corpus_dir=str(corpus)), engine=engine)) as c:
        yield c


def answer(client, **fields):
    body = {"question": QUESTION, "documents": DOCS, "max_new_tokens": 2, **fields}
    response = client.post("/v1/answer", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def chat(client, messages, **fields):
    body = {"model": "ragsnap", "messages": messages, "max_tokens": 2}
    body.update(fields)
    return client.post("/v1/chat/completions", json=body)


def test_a_budget_below_the_window_keeps_the_budget_and_shrinks_the_window(client):
    both = answer(client, compression={"press": "snapkv", "budget": 6, "window": 16})
    assert both["stats"]["press_config"]["window"] == 6
    assert both["stats"]["kept_tokens"] == 6 < both["stats"]["prompt_tokens"]
    # the server's window (8) shrinks to a request's budget too
    alone = answer(client, compression={"budget": 5})
    assert (alone["stats"]["press_config"]["window"], alone["stats"]["kept_tokens"]) == (5, 5)
    # and a request's window to the server's budget (48)
    wide = answer(client, compression={"window": 4096})
    assert wide["stats"]["press_config"]["window"] == FAST["budget"]
    assert wide["stats"]["kept_tokens"] == FAST["budget"]


def test_a_decode_window_over_its_slack_is_the_slack(client, engine):
    from ragsnap.engine.press_settings import PressOverrides
    from ragsnap.engine.request_options import resolve_decode

    decode = resolve_decode(engine.config, PressOverrides(decode_slack=2, decode_window=4096))
    assert decode is not None and (decode.slack, decode.window) == (2, 2)
    body = {"decode_slack": 2, "decode_window": 4096}
    done = answer(client, max_new_tokens=8, compression={**FAST, **body})
    assert done["stats"]["new_tokens"] > 3 and done["stats"]["decode_reselections"] > 0


def test_an_id_given_twice_is_one_document_or_made_unique(client):
    def cited_ids(documents):
        meta = answer(client, documents=documents, document_order="given")["meta"]
        return [d["id"] for d in meta["documents"]]

    # the same document again counts once
    assert cited_ids([DOCS[0], DOCS[1], dict(DOCS[0])]) == ["bees", "tides"]
    # another document with the id keeps its place, as bees~2 (then ~3); a default id (the
    # position) meets the same rule
    other = {**DOCS[1], "id": "bees"}
    assert cited_ids([DOCS[0], other, {**other, "text": "Moon."}]) == ["bees", "bees~2", "bees~3"]
    assert cited_ids([{"text": "Bees dance."}, {**DOCS[1], "id": 1}]) == ["1", "1~2"]


def test_a_query_no_passage_matches_gets_an_answer_over_none(corpus_client):
    asked = {"question": "What is the capital of France?", "max_new_tokens": 8}
    done = answer(corpus_client, documents=None, query="zzzz qqqq", **asked)
    assert done["meta"]["documents"] == [] and done["citations"] == []
    assert done["grounded"] is False
    found = corpus_client.post("/v1/search", json={"query": "zzzz qqqq"})
    assert found.status_code == 200 and found.json()["passages"] == []


def test_a_chat_with_no_documents_anywhere_gets_an_answer_over_none(client):
    asked = [{"role": "user", "content": "What is the capital of France?"}]
    response = chat(client, asked, max_tokens=8)
    assert response.status_code == 200, response.text
    reply = response.json()
    assert reply["documents"] == [] and reply["citations"] == []
    assert reply["ragsnap"]["grounded"] is False
    assert reply["choices"][0]["message"]["content"]


def test_a_chat_ending_with_an_assistant_turn_answers_the_last_user_message(client):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "The Moon."},
    ]
    response = chat(client, messages, documents=DOCS)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([{"role": "user", "content": "  \n"}], "messages[0]"),
        ([{"role": "user"}], "messages[0]"),
        ([{"role": "user", "content": [{"type": "text", "text": " "}]}], "messages[0]"),
        ([{"role": "user", "content": []}], "messages[0]"),
        # an earlier user message too: the schema states it of every user message
        ([{"role": "user", "content": ""}, {"role": "user", "content": QUESTION}], "messages[0]"),
        ([{"role": "system", "content": "Be brief."}], "messages"),  # no user message
    ],
)
def test_a_user_message_without_text_is_400_naming_it(client, messages, param):
    response = chat(client, messages, documents=DOCS)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_the_schema_states_the_user_message_rules(client):
    schema = client.get("/openapi.json").json()["components"]["schemas"]
    messages = schema["ChatCompletionRequest"]["properties"]["messages"]
    assert messages["contains"]["properties"]["role"] == {"const": "user"}
    message = schema["ChatMessage"]
    assert message["if"]["properties"]["role"] == {"const": "user"}
    assert message["then"]["required"] == ["content"]
    text, parts = message["then"]["properties"]["content"]["anyOf"]
    assert text["type"] == "string" and text["pattern"].startswith("[^")
    assert parts["contains"]["properties"]["text"]["pattern"] == text["pattern"]
    # what the meanings are, where a client reads the fields
    compression = schema["CompressionIn"]["properties"]
    assert "the window shrinks to the budget" in compression["budget"]["description"]
    assert (
        "over the slack (its own or the server's) is the slack"
        in (compression["decode_window"]["description"])
    )
    assert "`<id>~2`" in schema["DocumentIn"]["properties"]["id"]["description"]


def test_a_last_user_message_whose_labels_leave_no_question_is_still_400(client):
    response = chat(client, [{"role": "user", "content": "Context: The Moon pulls."}])
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages" and "holds no question" in error["message"]
