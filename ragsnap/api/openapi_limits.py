"""What the OpenAPI schema says of this server: its own limits and what it lacks.

The request models state what holds for every server (bounds, one of documents or query,
odd kernels). This adds what the server's :class:`~ragsnap.api.settings.Settings` and model
decide, where JSON Schema can say it: the most documents, the longest question, the largest
answer and ``top_k``; the deepest ``propagate_layer``; without a corpus, no ``query`` and no
``/v1/search``; which press takes which option (the default press is the server's); the
OpenAI fields the chat route accepts, with the values it accepts them with. A schema-valid
request is then accepted, except for what JSON Schema cannot read (a chat's last user
message whose labels leave no question: only context, a bare ``Question:``) or count (bytes
and tokens: 413). What it cannot compare or look up has a meaning instead, stated in the
fields' descriptions: a budget below the window shrinks the window, a decode window over its
slack is the slack, an id given twice names one document or is made unique (``id~2``), a
query no passage matches gets an answer over no documents.
"""

from __future__ import annotations

import json
from typing import Any

from ragsnap.api.settings import Settings
from ragsnap.compression import PRESSES, press_options

NO_CORPUS = "this server has no corpus (RAGSNAP_CORPUS_DIR): always null"


def state_limits(schema: dict[str, Any], settings: Settings) -> None:
    """Write ``settings``' limits into ``schema`` (an OpenAPI document, changed in place)."""
    models = schema.get("components", {}).get("schemas", {})
    corpus = settings.corpus_dir is not None
    for name in ("AnswerRequest", "ChatCompletionRequest", "SearchRequest"):
        if name in models:
            models[name]["properties"]["top_k"]["maximum"] = settings.max_top_k
    for name in ("AnswerRequest", "ChatCompletionRequest"):
        if name not in models:
            continue
        fields = models[name]["properties"]
        fields["documents"]["maxItems"] = settings.max_documents
        if not corpus:
            fields["query"] = {"type": "null", "description": NO_CORPUS}
            fields["top_k"]["description"] = "unused: " + NO_CORPUS
    if "AnswerRequest" in models:
        fields = models["AnswerRequest"]["properties"]
        fields["question"]["maxLength"] = settings.max_question_chars
        fields["max_new_tokens"]["maximum"] = settings.max_new_tokens_limit
    if "ChatCompletionRequest" in models:
        chat = models["ChatCompletionRequest"]
        for name in ("max_tokens", "max_completion_tokens"):
            chat["properties"][name]["maximum"] = settings.max_new_tokens_limit
        _openai_extras(chat)
    if "CompressionIn" in models:
        models["CompressionIn"]["allOf"] = _press_rules(settings)
    if not corpus:
        schema.get("paths", {}).pop("/v1/search", None)


def state_model_limits(schema: dict[str, Any], num_layers: int) -> None:
    """Write the served model's limits into ``schema``: the deepest ``propagate_layer``."""
    models = schema.get("components", {}).get("schemas", {})
    if "CompressionIn" in models:
        models["CompressionIn"]["properties"]["propagate_layer"]["maximum"] = num_layers - 1


def _openai_extras(chat: dict[str, Any]) -> None:
    """The OpenAI fields ragsnap leaves unused, each with the values that mean "off", and
    the inert ones; any other field is refused (400)."""
    from ragsnap.api.openai_serving import _INERT, _OFF_VALUES

    for name, values in _OFF_VALUES.items():
        chat["properties"].setdefault(name, {"enum": _json_equal(values)})
    for name in _INERT:
        chat["properties"].setdefault(name, {"description": "accepted, not used"})
    chat["additionalProperties"] = False


def _json_equal(values: tuple[Any, ...]) -> list[Any]:
    """``values`` and the JSON values Python finds equal to one (``False == 0``)."""
    out: list[Any] = []
    for value in values:
        if value is False or (type(value) in (int, float) and value == 0):
            out += [False, 0]
        else:
            out.append(value)
    unique: dict[str, Any] = {json.dumps(v, sort_keys=True): v for v in out}
    return [v for k, v in unique.items() if k != "0.0"]


def _press_rules(settings: Settings) -> list[dict[str, Any]]:
    """``if``/``then`` rules: an option a press does not take stays unset with that press
    (or with no press named, when the server's default press does not take it); a decode
    window needs a decode slack (unless the server sets one)."""
    rules = []
    for option, unset in (
        ("kernel", {"type": "null"}),
        ("pooling", {"type": "null"}),
        ("lookahead", {"enum": [None, 0]}),
    ):
        refusing = [
            name for name in PRESSES if name != "full" and option not in press_options(name)
        ]
        if not refusing:
            continue
        named: dict[str, Any] = {"properties": {"press": {"enum": refusing}}}
        if settings.default_press in refusing:  # unset or null: the server's press
            named = {"properties": {"press": {"enum": [*refusing, None]}}}
        else:
            named["required"] = ["press"]
        rules.append({"if": named, "then": {"properties": {option: unset}}})
    if settings.decode_slack is None:
        rules.append(
            {
                "if": {
                    "required": ["decode_window"],
                    "properties": {"decode_window": {"type": "integer"}},
                },
                "then": {
                    "required": ["decode_slack"],
                    "properties": {"decode_slack": {"type": "integer"}},
                },
            }
        )
    return rules
