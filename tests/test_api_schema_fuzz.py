"""schemathesis over the served OpenAPI schema: generated requests (valid and invalid) on
every operation of the real server, with every check: none gets a 5xx, every response
matches what the schema says (status codes, bodies, content types, headers), schema-invalid
requests are refused, and schema-valid ones are accepted, except for the few rules JSON
Schema cannot state (:data:`BEYOND_JSON_SCHEMA`). Run on a server without a corpus (no
``query``, no ``/v1/search`` in its schema) and on one with a corpus.

Examples are bounded per operation so the run stays within a minute or two on a CPU; the
limits are small so a schema-valid request is cheap to answer."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.specs.openapi.checks import positive_data_acceptance  # noqa: E402

from tests.api_helpers import fast_settings, running_server  # noqa: E402

pytestmark = pytest.mark.model

MAX_EXAMPLES = 12
# (status, param prefix, message part): refusals of schema-valid requests for what JSON
# Schema cannot say: counts of bytes and tokens (413, any param; the schema states them as
# limits), and what the labels of a chat's last user message leave of its question (only
# context, a bare "Question:"; a regular expression cannot tell the last user message from
# the others). Comparisons of two fields, repeated ids and a corpus that finds nothing have
# a meaning instead (tests/test_api_schema_rules.py)
BEYOND_JSON_SCHEMA = (
    (413, "", ""),
    (400, "messages", "the last user message holds no question"),
)


def _limits(**extra):
    return fast_settings(
        max_documents=3,
        max_document_bytes=400,
        max_total_bytes=800,
        max_question_chars=200,
        max_document_tokens=120,
        max_question_tokens=60,
        max_prompt_tokens=300,
        max_new_tokens_limit=2,
        default_max_new_tokens=2,
        max_body_bytes=4_000_000,  # invalid bodies reach validation (a 413 would come first)
        max_queue=64,
        **extra,
    )


@pytest.fixture(scope="module")
def api_schema(engine):
    from ragsnap.api.app import create_app

    with running_server(create_app(_limits(), engine=engine)) as base:
        yield schemathesis.openapi.from_url(f"{base}/openapi.json")


@pytest.fixture(scope="module")
def corpus_schema(engine, tmp_path_factory):
    from ragsnap.api.app import create_app

    corpus = tmp_path_factory.mktemp("corpus")
    (corpus / "tides.md").write_text("Tides are caused mostly by the gravity of the Moon.\n")
    (corpus / "bees.md").write_text("Honeybees dance to say where the flowers are.\n")
    with running_server(create_app(_limits(corpus_dir=str(corpus)), engine=engine)) as base:
        yield schemathesis.openapi.from_url(f"{base}/openapi.json")


def beyond_json_schema(response) -> bool:
    """Whether ``response`` refuses a request for a rule :data:`BEYOND_JSON_SCHEMA` lists."""
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    param, message = error.get("param") or "", error.get("message") or ""
    return any(
        response.status_code == status and param.startswith(prefix) and part in message
        for status, prefix, part in BEYOND_JSON_SCHEMA
    )


def fuzz_operation(operation, mode) -> None:
    """``MAX_EXAMPLES`` requests of ``mode`` on ``operation``, every check on each."""

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def check(case):
        # every check; positive_data_acceptance with the rules JSON Schema cannot state
        response = case.call_and_validate(excluded_checks=[positive_data_acceptance])
        if mode is GenerationMode.POSITIVE and response.status_code in (400, 413, 422):
            assert beyond_json_schema(response), (
                f"{operation.label}: a schema-valid request was refused: "
                f"{response.status_code} {response.text[:300]}\nbody: {case.body!r}"[:1200]
            )

    try:
        check()
    except Unsatisfiable:  # nothing to get wrong in a request without parameters
        assert mode is GenerationMode.NEGATIVE and not operation.body, operation.label


def fuzz(api_schema) -> set[str]:
    """Every operation of ``api_schema`` in both modes; the operations' labels."""
    operations = [result.ok() for result in api_schema.get_all_operations()]
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            fuzz_operation(operation, mode)
    return {op.label for op in operations}


def test_no_server_error_and_no_schema_mismatch(api_schema):
    labels = fuzz(api_schema)
    assert {"POST /v1/answer", "POST /v1/chat/completions", "GET /readyz"} <= labels
    assert "POST /v1/search" not in labels  # no corpus: the schema offers no search


def test_a_server_with_a_corpus_offers_and_answers_query_and_search(corpus_schema):
    labels = fuzz(corpus_schema)
    assert {"POST /v1/answer", "POST /v1/search"} <= labels


def test_the_schema_states_what_the_server_refuses(api_schema):
    """The three rules schemathesis found refused while the schema allowed them (issue 55)."""
    raw = api_schema.raw_schema
    models = raw["components"]["schemas"]
    answer = models["AnswerRequest"]
    # documents and query: exactly one (here: no corpus, so query is always null)
    assert answer["not"]["required"] == ["documents", "query"]
    assert answer["properties"]["query"] == {
        "type": "null",
        "description": answer["properties"]["query"]["description"],
    }
    # a seed past the signed 64-bit range: the bound is exact (an integer, not a double)
    for name in ("AnswerRequest", "ChatCompletionRequest"):
        seed = next(s for s in models[name]["properties"]["seed"]["anyOf"] if "type" in s)
        assert seed["exclusiveMaximum"] == 2**63 and isinstance(seed["exclusiveMaximum"], int)
    assert "/v1/search" not in raw["paths"]
