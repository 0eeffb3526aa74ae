"""A document's declared format travels through the CLI loader, the API schema and LangChain."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from ragsnap.api.answering import inline_documents
from ragsnap.api.schemas import DocumentIn
from ragsnap.api.settings import Settings
from ragsnap.compression import make_press
from ragsnap.errors import InputError
from ragsnap.integrations.langchain.retriever import from_langchain_documents, to_langchain_document
from ragsnap.prompt.documents import Document, load_documents


def test_jsonl_documents_declare_their_format(tmp_path) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text(
        json.dumps({"id": "a", "text": "x,y\n1,2", "format": "csv", "source": "s3"})
        + "\n"
        + json.dumps({"id": "b", "text": "plain words"})
        + "\n"
    )
    a, b = load_documents([path])
    assert a.format == "csv" and a.metadata == {"source": "s3"}  # not left in metadata
    assert b.format is None
    path.write_text(json.dumps({"id": "a", "text": "x", "format": "yaml"}) + "\n")
    with pytest.raises(InputError, match="format"):
        load_documents([path])


def test_api_documents_take_a_format() -> None:
    [doc] = inline_documents([DocumentIn(id="t", text="<a>1</a>", format="xml")], Settings())
    assert doc.format == "xml"
    with pytest.raises(ValidationError):
        DocumentIn(text="x", format="yaml")  # type: ignore[arg-type]


def test_langchain_metadata_keeps_the_format() -> None:
    original = Document(id="t", text='{"a": 1}', title="T", format="json")
    lc = to_langchain_document(original)
    assert lc.metadata["format"] == "json"
    [back] = from_langchain_documents([lc])
    assert back.format == "json" and back.content_hash == original.content_hash
    # a loader's own "format" (e.g. a file type) is not a declaration: detect instead
    lc.metadata["format"] = "pdf"
    [other] = from_langchain_documents([lc])
    assert other.format is None


def test_keep_instruction_is_an_api_and_cli_compression_option() -> None:
    from ragsnap.api.schemas import CompressionIn

    fields = CompressionIn(press="snapkv", budget=64, keep_instruction=True).model_dump(
        exclude={"press"}, exclude_none=True
    )
    press = make_press("snapkv", **fields)
    assert press.config()["keep_instruction"] is True


def test_lookup_is_an_api_compression_option() -> None:
    from ragsnap.api.schemas import CompressionIn

    fields = CompressionIn(press="ragsnap", budget=64, lookup=True).model_dump(
        exclude={"press"}, exclude_none=True
    )
    press = make_press("ragsnap", **fields)
    assert press.config()["lookup"] is True and press.config()["press"] == "ragsnap"
