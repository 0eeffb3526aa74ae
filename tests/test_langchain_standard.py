"""LangChain's own standard suites (``langchain-tests``), pointed at ragsnap's classes.

The chat model unit suite needs no model (it checks construction, standard parameters and
tracing fields); the retriever integration suite runs BM25 over the bundled samples.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

from langchain_tests.integration_tests import RetrieversIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from ragsnap.integrations.langchain import ChatRagSnap, RagSnapRetriever
from ragsnap.retrieval.bm25 import BM25Index

SAMPLES = Path(__file__).resolve().parents[1] / "ragsnap" / "samples"


@cache
def sample_index() -> BM25Index:
    return BM25Index.from_directory(SAMPLES)


class TestChatRagSnapStandard(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatRagSnap]:
        return ChatRagSnap

    @property
    def chat_model_params(self) -> dict[str, Any]:
        # a server that is never called: the unit suite makes no requests
        return {"base_url": "http://127.0.0.1:9", "model": "ragsnap"}

    @property
    def init_from_env_params(self) -> tuple[dict[str, str], dict[str, Any], dict[str, Any]]:
        env = {"RAGSNAP_BASE_URL": "http://127.0.0.1:9", "RAGSNAP_API_KEY": "env-key"}
        return env, {}, {"base_url": "http://127.0.0.1:9", "api_key": "env-key"}

    @property
    def has_tool_calling(self) -> bool:
        return False  # bind_tools is overridden only to refuse with a clear message

    @property
    def has_structured_output(self) -> bool:
        return False


class TestRagSnapRetrieverStandard(RetrieversIntegrationTests):
    @property
    def retriever_constructor(self) -> type[RagSnapRetriever]:
        return RagSnapRetriever

    @property
    def retriever_constructor_params(self) -> dict[str, Any]:
        return {"index": sample_index()}

    @property
    def retriever_query_example(self) -> str:
        return "the Moon, bees, penicillin and the Rosetta Stone"
