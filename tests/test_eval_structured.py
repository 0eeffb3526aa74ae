"""Structured-lookup items and the key-value retrieval loader (no shared data needed)."""

from __future__ import annotations

import gzip
import json
import xml.etree.ElementTree as ET

import pytest

from ragsnap.errors import ConfigError
from ragsnap.eval.evaluate import EvalRequest, evaluate
from ragsnap.eval.structured import STRUCTURES, build_structured, load_kv_retrieval
from ragsnap.prompt.assembly import assemble_prompt
from ragsnap.prompt.structure import character_roles
from tests.tiny_models import tiny_engine, tiny_tokenizer


def test_structured_items_fit_their_length_and_know_where_the_value_is() -> None:
    tokenizer = tiny_tokenizer()
    loaded = build_structured(tokenizer, lengths=[300, 600], samples=2, seed=3)
    assert not loaded.malformed
    assert len(loaded.items) == 2 * len(STRUCTURES) * 2
    for item in loaded.items:
        [document] = item.documents
        text, [value] = document.text, item.answers
        lo, hi = item.metadata["value_span"]
        assert text[lo:hi] == value and text.count(value) == 1 and len(value) == 7
        assert item.metadata["key"] in item.question and item.metadata["key"] in text
        length = item.metadata["length"]
        layout = assemble_prompt(
            tokenizer,
            item.question,
            item.documents,
            max_prompt_tokens=10 * length,
            answer_prefix=item.answer_prefix,
        )
        structure = item.metadata["structure"]
        assert layout.num_tokens <= length  # never over
        if structure != "compact-json":  # (one whitespace word for this tokenizer, any size)
            assert layout.num_tokens > 0.8 * length  # filled
        tagged = character_roles(text, document.format)
        assert tagged is not None, item.id  # every rendering parses as its declared format
        if structure.endswith("json"):
            inventory = json.loads(text)["inventory"]
            assert inventory[item.metadata["key"]]["value"] == int(value)
        elif structure == "xml":
            found = ET.fromstring(text).find(f"item[@key='{item.metadata['key']}']/value")
            assert found is not None and found.text == value
    again = build_structured(tokenizer, lengths=[300, 600], samples=2, seed=3)
    assert [i.question for i in again.items] == [i.question for i in loaded.items]
    other = build_structured(tokenizer, lengths=[300, 600], samples=2, seed=4)
    assert [i.question for i in other.items] != [i.question for i in loaded.items]


def test_kv_retrieval_loader_cuts_to_the_context_around_the_asked_pair(tmp_path) -> None:
    pairs = [[f"k{i:02d}-aaaa", f"v{i:02d}-bbbb"] for i in range(40)]
    good = {"ordered_kv_records": pairs, "key": "k30-aaaa", "value": "v30-bbbb"}
    lines = [
        json.dumps(good),
        json.dumps({"ordered_kv_records": pairs, "key": "k99", "value": "v99"}),  # not there
        "{not json",
        "",
    ]
    path = tmp_path / "kv.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        handle.write("\n".join(lines))
    words = lambda text: len(text.split())  # noqa: E731
    loaded = load_kv_retrieval(path, context_tokens=40, count_tokens=words)
    assert [m.where for m in loaded.malformed] == ["kv.jsonl.gz:2", "kv.jsonl.gz:3"]
    [item] = loaded.items
    text = item.documents[0].text
    assert words(text) <= 40 and item.metadata["records"] < 40
    assert json.loads(text)["k30-aaaa"] == "v30-bbbb"  # the asked pair survives the cut
    lo, hi = item.metadata["value_span"]
    assert text[lo:hi] == "v30-bbbb" and item.answers == ["v30-bbbb"]
    whole = load_kv_retrieval(path).items[0]
    assert len(json.loads(whole.documents[0].text)) == 40


def test_structured_requests_are_checked_before_any_model_work(tmp_path) -> None:
    request = EvalRequest(out=tmp_path, format="structured", structures=["yaml"])
    with pytest.raises(ConfigError):
        request.validate()
    EvalRequest(out=tmp_path, format="structured", structures=["xml"]).validate()  # no --data


def test_a_structured_eval_reports_the_asked_values_retention(tmp_path) -> None:
    request = EvalRequest(
        out=tmp_path,
        format="structured",
        presses=["snapkv", "roles"],
        budgets=[40],
        lengths=[200],
        structures=["nested-json", "table"],
        plots=False,
        progress=False,
    )
    result = evaluate(tiny_engine("llama").runtime, request)
    assert result.evaluated == 2 and result.malformed == 0
    runs = {(r["press"], r["budget"]): r for r in result.runs}
    assert set(runs) == {("full", None), ("snapkv", 40), ("roles", 40)}
    assert runs[("full", None)]["metrics"]["needle_kept_share"] == 1.0
    records = [json.loads(line) for line in (tmp_path / "predictions.jsonl").open()]
    assert {r["meta"]["structure"] for r in records} == {"nested-json", "table"}
    for record in records:  # every press and item reports the asked value's retention
        assert 0.0 <= record["scores"]["needle_kept_share"] <= 1.0
        assert record["prompt_tokens"] <= 200
        assert record["kept_tokens"] == (
            40 if record["press"] != "full" else record["prompt_tokens"]
        )
