"""Lookup focus: the record a question names on a structured document, and the press that keeps it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
import torch

from ragsnap.cache import open_store
from ragsnap.compression import KeepInstructionPress, LookupFocusPress, make_press
from ragsnap.compression.base import CompressedLayer, LayerContext
from ragsnap.compression.lookup_focus import uses_focus
from ragsnap.compression.snapkv import SnapKVPress
from ragsnap.engine.engine import AnswerOptions, RagSnapEngine
from ragsnap.errors import ConfigError
from ragsnap.eval.grid import press_grid
from ragsnap.prompt.documents import Document
from ragsnap.prompt.focus import focus_chars, prompt_focus
from ragsnap.runtime.generation import GenerationConfig
from tests.tiny_models import tiny_engine


def _marked(text: str, tiers: list[int]) -> str:
    """The tier of every non-space character, spaces kept: a picture to compare by hand."""
    return "".join(str(t) if c.strip() else c for c, t in zip(text, tiers, strict=True))


def _focused(text: str, tiers: list[int], tier: int) -> str:
    return "".join(c for c, t in zip(text, tiers, strict=True) if t == tier)


NESTED = json.dumps(
    {
        "inventory": {
            "amber-fox-12": {"value": 1111111, "status": "active"},
            "brave-owl-34": {"value": 2222222, "status": "active"},
            "calm-elk-56": {"value": 3333333, "status": "active"},
        }
    },
    indent=1,
)


def test_nested_json_focuses_the_named_record_and_its_asked_field() -> None:
    tiers = focus_chars(NESTED, "What is the value of key brave-owl-34?")
    assert tiers is not None
    assert _marked(NESTED, tiers).splitlines() == [
        "0",
        " 000000000000 0",
        "  000000000000000 0",
        "   00000000 00000000",
        "   000000000 00000000",
        "  00",
        "  111111111111111 1",  # the record's own name: tier 1
        "   33333333 44444441",  # the field the question names: its value is tier 4
        "   111111111 12222221",  # the rest of the record: values 2, the scaffolding 1
        "  10",
        "  00000000000000 0",
        "   00000000 00000000",
        "   000000000 00000000",
        "  0",
        " 0",
        "0",
    ]


def test_xml_table_csv_jsonl_and_key_value_data_focus_the_asked_value() -> None:
    xml = (
        '<items>\n <item sku="A-1"><price>10</price></item>\n'
        ' <item sku="B-2"><price>20</price></item>\n'
        ' <item sku="C-3"><price>30</price></item>\n</items>'
    )
    table = "| sku | price |\n|---|---|\n| A-1 | 10 |\n| B-2 | 20 |\n| C-3 | 30 |"
    csv_text = "sku,price\nA-1,10\nB-2,20\nC-3,30\n"
    jsonl = "\n".join(json.dumps({"sku": s, "price": p}) for s, p in [("A-1", 10), ("B-2", 20)])
    question = "What is the price of item B-2?"
    for text, fmt in [(xml, "xml"), (table, "markdown"), (csv_text, "csv"), (jsonl, "jsonl")]:
        tiers = focus_chars(text, question, fmt)
        assert tiers is not None, fmt
        assert _focused(text, tiers, 4) == "20", fmt  # the named field of the named record
        record_line = next(line for line in text.splitlines() if "B-2" in line)
        start = text.index(record_line)
        outside = tiers[:start] + tiers[start + len(record_line) :]
        assert not any(outside), fmt  # no other record is focused
    kv = json.dumps({"k-aa11": "v-zz99", "k-bb22": "v-yy88", "k-cc33": "v-xx77"}, indent=1)
    tiers = focus_chars(kv, 'What is the value of key "k-bb22"?', "json")
    assert tiers is not None
    assert _focused(kv, tiers, 2) == "v-yy88" and _focused(kv, tiers, 1) == '"k-bb22": ""'


def test_no_focus_for_prose_unnamed_records_common_words_or_malformed_text() -> None:
    assert focus_chars("The fox at A-1 costs 10. The owl costs 20.", "price of A-1?") is None
    assert focus_chars(NESTED, "What is the value of key dull-ant-99?") is None
    # "active" is in every record: it names none of them
    assert focus_chars(NESTED, "Which item is active?") is None
    assert focus_chars('{"a": [1, 2', "what is a?", "json") is None  # malformed: prose
    assert focus_chars("<a><b>1</a>", "what is b?", "xml") is None
    assert focus_chars("| x |\n| 1 |", "x", "markdown") is None  # no separator line


def test_two_named_records_are_both_focused() -> None:
    tiers = focus_chars(NESTED, "Compare amber-fox-12 with calm-elk-56.")
    assert tiers is not None
    assert "1111111" in _focused(NESTED, tiers, 2) and "3333333" in _focused(NESTED, tiers, 2)
    assert "2222222" not in "".join(c for c, t in zip(NESTED, tiers, strict=True) if t)


# -- the press ------------------------------------------------------------------------

DOCS = [
    Document(id="prose", title="t2", text="t3 t4 t5 t6 t7 t8 t9 t10 t11 t12 t13 t14 t15"),
    Document(
        id="table",
        title="t16",
        text="| t17 | t18 |\n|---|---|\n"
        + "\n".join(f"| t{i} | t{i + 1} t{i + 2} |" for i in range(20, 80, 3)),
    ),
]
QUESTION = "t50 t86 t87"  # names the row "| t50 | t51 t52 |"


def _layout(engine: RagSnapEngine, question: str = QUESTION):
    return engine.build_prompt(question, DOCS, GenerationConfig(max_new_tokens=2))


def test_the_prompt_focus_marks_the_named_row_only() -> None:
    engine = tiny_engine("llama")
    layout = _layout(engine)
    focus = prompt_focus(engine.tokenizer, layout)
    assert focus is not None and focus.shape == (layout.num_tokens,)
    named = {layout.input_ids[p] for p in focus.nonzero().flatten().tolist()}
    assert {50, 51, 52} <= named and not named & {20, 21, 22, 53, 86}
    assert prompt_focus(engine.tokenizer, _layout(engine, "t86 t87")) is None


@pytest.mark.parametrize("name", ["snapkv", "ragsnap", "roles", "ragsnap-roles"])
def test_the_named_record_is_kept_at_a_tiny_budget_within_the_exact_budget(name: str) -> None:
    engine = tiny_engine("llama")
    layout = _layout(engine)
    focus = prompt_focus(engine.tokenizer, layout)
    assert focus is not None
    row = (focus >= 2).nonzero().flatten()  # the row's cells (tier 1, its pipes, may go)
    budget, window = 16, 4
    plain = make_press(name, budget=budget, window=window)
    focused = make_press(name, budget=budget, window=window, lookup=True)
    base, boosted = engine.runtime.prefill_many(
        layout.input_ids, [plain, focused], roles=None, focus=focus
    )
    assert boosted.kept_tokens_per_layer == [budget] * 4  # the budget is exact
    for layer in boosted.kept:
        for head in layer.indices[0]:
            assert set(row.tolist()) <= set(head.tolist())  # every head keeps the whole row
    assert any(
        not set(row.tolist()) <= set(h.tolist()) for layer in base.kept for h in layer.indices[0]
    )  # the plain press does not


def test_higher_tiers_are_kept_first_when_the_record_does_not_fit() -> None:
    engine = tiny_engine("llama")
    layout = _layout(engine)
    focus = torch.zeros(layout.num_tokens, dtype=torch.uint8)
    focus[10:30] = 1
    focus[12:15] = 4
    [kept] = engine.runtime.prefill_many(
        layout.input_ids,
        [LookupFocusPress(base=make_press("snapkv", budget=10, window=4), from_tier=1)],
        focus=focus,
    )
    for layer in kept.kept:
        for head in layer.indices[0].tolist():
            prefix = [p for p in head if p < layout.num_tokens - 4]
            assert {12, 13, 14} <= set(prefix) and all(10 <= p < 30 for p in prefix)


def test_without_focus_the_press_is_its_base() -> None:
    engine = tiny_engine("llama")
    layout = _layout(engine)
    presses = [
        make_press("ragsnap", budget=20, window=4),
        make_press("ragsnap-lookup", budget=20, window=4),
    ]
    plain, focused = engine.runtime.prefill_many(layout.input_ids, presses, focus=None)
    for a, b in zip(plain.kept, focused.kept, strict=True):
        assert torch.equal(a.indices, b.indices) and torch.equal(a.values, b.values)


def test_lookup_is_an_option_of_every_press() -> None:
    press = make_press("snapkv", budget=32, window=8, lookup=True)
    assert isinstance(press, LookupFocusPress) and press.config()["lookup"] is True
    assert make_press("ragsnap-lookup", budget=32).config() == {
        **make_press("ragsnap", budget=32).config(),
        "lookup": True,
        "from_tier": 2,
    }
    grid = press_grid(["snapkv", "tova"], [32], options={"lookup": True})
    assert all(isinstance(g.instance, LookupFocusPress) for g in grid[1:])


@dataclass
class _SeesFocus(SnapKVPress):
    """SnapKV that remembers the focus each layer was given."""

    name = "sees-focus"
    seen: list[torch.Tensor | None] = field(default_factory=list, compare=False, repr=False)

    def config(self) -> dict:
        return {"press": self.name, "budget": self.budget, "window": self.window}

    def compress(self, layer: LayerContext) -> CompressedLayer:
        self.seen.append(None if layer.focus is None else layer.focus.clone())
        return super().compress(layer)


def test_every_answer_path_hands_the_focus_to_the_press(tmp_path) -> None:
    base = tiny_engine("llama")
    sees = _SeesFocus(budget=24, window=4)
    press = LookupFocusPress(base=sees)

    def answer(engine: RagSnapEngine, question: str) -> str:
        options = AnswerOptions(press=press, generation=GenerationConfig(max_new_tokens=2))
        return str(engine.answer(question, DOCS, options).stats.cache)

    assert answer(base, QUESTION) == "off"
    cached = RagSnapEngine(base.loaded, store=open_store(f"file://{tmp_path}"))
    assert answer(cached, QUESTION) == "miss"
    assert answer(cached, "t62 t86") == "prefix-hit"
    expected = prompt_focus(base.tokenizer, _layout(base))
    other = prompt_focus(base.tokenizer, _layout(base, "t62 t86"))
    assert expected is not None and other is not None and not torch.equal(expected, other)
    per_layer = len(sees.seen) // 3
    for i, seen in enumerate(sees.seen):
        want = expected if i < 2 * per_layer else other
        assert seen is not None and torch.equal(seen, want)
    # a press that does not use the focus is not given one (nor is it computed)
    plain = _SeesFocus(budget=24, window=4)
    options = AnswerOptions(press=plain, generation=GenerationConfig(max_new_tokens=2))
    base.answer(QUESTION, DOCS, options)
    assert plain.seen and all(seen is None for seen in plain.seen)


def test_uses_focus_finds_the_wrapper_at_any_depth() -> None:
    assert uses_focus(make_press("ragsnap-lookup", budget=32))
    wrapped = KeepInstructionPress(base=make_press("ragsnap", budget=32, lookup=True))
    assert uses_focus(wrapped)
    assert uses_focus(make_press("snapkv"), make_press("snapkv", lookup=True))
    assert not uses_focus(make_press("ragsnap", budget=32), make_press("ragsnap-roles"))


def test_from_tier_leaves_the_lower_tiers_to_the_base_press() -> None:
    engine = tiny_engine("llama")
    layout = _layout(engine)
    focus = torch.zeros(layout.num_tokens, dtype=torch.uint8)
    focus[10:30] = 1
    focus[12:15] = 4
    only_top = torch.where(focus >= 2, focus, torch.zeros_like(focus))
    lean = LookupFocusPress(base=make_press("snapkv", budget=10, window=4), from_tier=2)
    full = LookupFocusPress(base=make_press("snapkv", budget=10, window=4), from_tier=1)
    [a] = engine.runtime.prefill_many(layout.input_ids, [lean], focus=focus)
    [b] = engine.runtime.prefill_many(layout.input_ids, [full], focus=only_top)
    [c] = engine.runtime.prefill_many(layout.input_ids, [full], focus=focus)
    assert all(torch.equal(x.indices, y.indices) for x, y in zip(a.kept, b.kept, strict=True))
    assert not all(torch.equal(x.indices, y.indices) for x, y in zip(a.kept, c.kept, strict=True))
    for layer in a.kept:
        assert all({12, 13, 14} <= set(head) for head in layer.indices[0].tolist())
    with pytest.raises(ConfigError):
        LookupFocusPress(base=make_press("snapkv"), from_tier=5)


@pytest.mark.model
def test_the_asked_value_survives_a_five_percent_budget_on_the_embedded_model(engine) -> None:
    from ragsnap.eval.metrics import kept_share
    from ragsnap.eval.runner import evidence_token_spans
    from ragsnap.eval.structured import build_structured

    items = build_structured(engine.tokenizer, lengths=[1000], structures=["nested-json", "xml"])
    for item in items.items:
        layout = engine.build_prompt(
            item.question,
            item.documents,
            GenerationConfig(max_new_tokens=2),
            answer_prefix=item.answer_prefix,
        )
        focus = prompt_focus(engine.tokenizer, layout)
        budget = layout.num_tokens // 20
        presses = [
            make_press("ragsnap", budget=budget),
            make_press("ragsnap-lookup", budget=budget),
        ]
        plain, focused = engine.runtime.prefill_many(layout.input_ids, presses, focus=focus)
        spans = evidence_token_spans(engine.tokenizer, layout, item, "value_span")
        assert focused.kept_tokens_per_layer == plain.kept_tokens_per_layer
        kept_plain = kept_share(plain.keep_rate(), spans)
        kept_focused = kept_share(focused.keep_rate(), spans)
        assert kept_plain is not None and kept_focused is not None
        assert kept_focused >= 0.9 > kept_plain, item.id
