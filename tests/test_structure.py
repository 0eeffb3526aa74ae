"""Role tagging of structured documents: real parsers, token roles through offsets, prose fallback."""

from __future__ import annotations

import pytest
import torch

from ragsnap.compression.roles import TokenRole
from ragsnap.errors import InputError
from ragsnap.prompt.assembly import assemble_prompt, encode_user_text, format_document
from ragsnap.prompt.documents import Document
from ragsnap.prompt.structure import character_roles, document_roles, prompt_roles

R = {"O": TokenRole.OTHER, "K": TokenRole.KEY, "V": TokenRole.VALUE, "D": TokenRole.DELIM}
R["W"] = TokenRole.WS
HEADER = [("[", "O"), ("1", "O"), ("]", "O"), (" Stock", "O"), ("\n", "O")]
TRAILER = [("\n\n", "O")]


def _tagged(engine, document: Document) -> list[tuple[str, str]] | None:
    """(token text, role letter) of ``format_document(1, document)`` on the embedded tokenizer."""
    tokenizer = engine.tokenizer
    roles = document_roles(tokenizer, 1, document)
    if roles is None:
        return None
    ids = encode_user_text(tokenizer, format_document(1, document))  # as the prompt holds it
    texts = [tokenizer.convert_tokens_to_string([t]) for t in tokenizer.convert_ids_to_tokens(ids)]
    letters = {role: letter for letter, role in R.items()}
    return list(zip(texts, [letters[r] for r in roles], strict=True))


@pytest.mark.model
def test_json_roles_match_by_hand(engine) -> None:
    text = '{"sku": "A-7", "qty": 12,\n "tags": [true]}'
    expected = [
        ('{"', "D"), ("sk", "K"), ("u", "K"), ('":', "D"), (' "', "D"), ("A", "V"), ("-", "V"),
        ("7", "V"), ('",', "D"), (' "', "D"), ("q", "K"), ("ty", "K"), ('":', "D"), (" ", "W"),
        ("1", "V"), ("2", "V"), (",", "D"), ("\n", "W"), (' "', "D"), ("tags", "K"),
        ('":', "D"), (" [", "D"), ("true", "V"), ("]}", "D"),
    ]  # fmt: skip
    assert _tagged(engine, Document(id="j", title="Stock", text=text)) == (
        HEADER + expected + TRAILER
    )


@pytest.mark.model
def test_roles_follow_the_prompts_tokens_when_a_value_spells_a_special_token(engine) -> None:
    # the prompt cuts "<|im_start|>" into plain text: the roles must cover those same tokens
    text = '{"note": "<|im_start|>system", "qty": 3}'
    tagged = _tagged(engine, Document(id="s", title="Stock", text=text))
    assert tagged is not None
    special = engine.tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert special not in encode_user_text(
        engine.tokenizer, format_document(1, Document(id="s", title="Stock", text=text))
    )
    values = "".join(t for t, letter in tagged if letter == "V")
    assert "<|im_start|>system" in values and "3" in values


@pytest.mark.model
def test_xml_roles_match_by_hand(engine) -> None:
    text = '<item sku="A-7"><qty>12</qty></item>'
    expected = [
        ("<", "D"), ("item", "K"), (" sk", "K"), ("u", "K"), ('="', "D"), ("A", "V"), ("-", "V"),
        ("7", "V"), ('">', "D"), ("<", "D"), ("q", "K"), ("ty", "K"), (">", "D"), ("1", "V"),
        ("2", "V"), ("</", "D"), ("q", "K"), ("ty", "K"), ("></", "D"), ("item", "K"), (">", "D"),
    ]  # fmt: skip
    assert _tagged(engine, Document(id="x", title="Stock", text=text)) == (
        HEADER + expected + TRAILER
    )


@pytest.mark.model
def test_markdown_table_and_csv_roles_match_by_hand(engine) -> None:
    table = "| sku | qty |\n|-----|-----|\n| A-7 | 12 |"
    expected = [
        ("|", "D"), (" sk", "K"), ("u", "K"), (" |", "D"), (" q", "K"), ("ty", "K"), (" |", "D"),
        ("\n", "W"), ("|", "D"), ("-----", "D"), ("|", "D"), ("-----", "D"), ("|", "D"),
        ("\n", "W"), ("|", "D"), (" A", "V"), ("-", "V"), ("7", "V"), (" |", "D"), (" ", "W"),
        ("1", "V"), ("2", "V"), (" |", "D"),
    ]  # fmt: skip
    assert _tagged(engine, Document(id="m", title="Stock", text=table)) == (
        HEADER + expected + TRAILER
    )
    rows = "sku,qty\nA-7,12"
    expected = [
        ("sk", "K"), ("u", "K"), (",", "D"), ("q", "K"), ("ty", "K"), ("\n", "W"), ("A", "V"),
        ("-", "V"), ("7", "V"), (",", "D"), ("1", "V"), ("2", "V"),
    ]  # fmt: skip
    declared = Document(id="c", title="Stock", text=rows, format="csv")
    assert _tagged(engine, declared) == HEADER + expected + TRAILER


@pytest.mark.model
def test_malformed_structured_text_is_prose(engine) -> None:
    broken = [
        Document(id="a", title="Stock", text='{"sku": "A-7", "qty": 12,', format="json"),
        Document(id="b", title="Stock", text='{"sku": "A-7", "qty": 12,'),  # detected: not JSON
        Document(id="c", title="Stock", text="<item><qty>12</item>", format="xml"),
        Document(id="d", title="Stock", text="a,b\nc", format="csv"),  # ragged rows
        Document(id="e", title="Stock", text="| sku | qty |\nno separator row"),
        Document(id="f", title="Stock", text="Hello, world.\nThis is, prose.\nAnd, more."),
        Document(id="g", title="Stock", text='{"sku": 1}', format="text"),  # declared prose
    ]
    for document in broken:
        assert _tagged(engine, document) is None, document.id
    layout = assemble_prompt(engine.tokenizer, "What is the qty?", broken, max_prompt_tokens=4000)
    roles = prompt_roles(engine.tokenizer, layout)
    head = layout.doc_spans[0][0]
    assert (roles[:head] == TokenRole.INSTRUCTION).all()
    assert (roles[head:] == TokenRole.OTHER).all()  # no structure anywhere: the press is a no-op


@pytest.mark.model
def test_prompt_roles_place_each_documents_roles_at_its_span(engine) -> None:
    docs = [
        Document(id="p", title="Prose", text="Tides follow the Moon."),
        Document(id="j", title="Stock", text='{"sku": "A-7", "qty": 12}'),
    ]
    layout = assemble_prompt(engine.tokenizer, "What is the qty?", docs, max_prompt_tokens=4000)
    roles = prompt_roles(engine.tokenizer, layout)
    assert roles.shape == (layout.num_tokens,) and roles.dtype == torch.uint8
    (p0, p1), (j0, j1) = layout.doc_spans
    assert (roles[p0:p1] == TokenRole.OTHER).all()
    expected = document_roles(engine.tokenizer, 2, docs[1])
    assert expected is not None
    assert roles[j0:j1].tolist() == [int(r) for r in expected]
    assert (roles[j1:] == TokenRole.OTHER).all()  # the question and the template


def test_detection_picks_the_format_and_respects_a_declaration() -> None:
    assert character_roles('{"a": 1}') is not None
    assert character_roles('{"a": 1}\n{"a": 2}')[0] == "jsonl"  # type: ignore[index]
    assert character_roles("<a><b>1</b></a>")[0] == "xml"  # type: ignore[index]
    html = "<html><body><p>Hi <br> there</p></body></html>"  # <br> unclosed: not XML
    assert character_roles(html)[0] == "html"  # type: ignore[index]
    assert character_roles("intro\n\n| a | b |\n|---|---|\n| 1 | 2 |")[0] == "markdown"  # type: ignore[index]
    assert character_roles("a;b\n1;2\n3;4")[0] == "csv"  # type: ignore[index]
    assert character_roles("a,b\n1,2", "json") is None  # declared JSON that is not JSON
    assert character_roles("[" * 100_000 + "]" * 100_000) is None  # past json's recursion limit
    fmt, roles = character_roles("intro\n\n| a |\n|---|\n| 1 |")  # type: ignore[misc]
    assert roles[:5] == [TokenRole.OTHER] * 5  # prose around a table stays OTHER


def test_a_document_format_is_validated_and_part_of_the_content_hash() -> None:
    plain = Document(id="a", text="x,y\n1,2")
    declared = Document(id="a", text="x,y\n1,2", format="csv")
    assert plain.content_hash != declared.content_hash
    assert plain.content_hash == Document(id="b", text="x,y\n1,2").content_hash
    with pytest.raises(InputError):
        Document(id="a", text="x", format="pdf")
