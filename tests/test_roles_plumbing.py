"""Token roles reach the press on every answer path: no cache, a cache miss, a prefix hit."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ragsnap.cache import open_store
from ragsnap.compression import make_press
from ragsnap.compression.base import CompressedLayer, LayerContext
from ragsnap.compression.roles import TokenRole
from ragsnap.compression.snapkv import SnapKVPress
from ragsnap.engine.engine import AnswerOptions, RagSnapEngine
from ragsnap.prompt.documents import Document
from ragsnap.prompt.structure import prompt_roles
from ragsnap.runtime.generation import GenerationConfig
from tests.tiny_models import tiny_engine

DOCS = [
    Document(id="prose", title="t2", text="t3 t4 t5 t6 t7 t8 t9 t10 t11 t12"),
    Document(
        id="table", title="t13", text="| t14 | t15 |\n|---|---|\n| t16 | t17 |\n| t18 | t19 |"
    ),
]


@dataclass
class _SeesRoles(SnapKVPress):
    """SnapKV that remembers the roles each layer was given."""

    name = "sees-roles"
    seen: list[torch.Tensor | None] = field(default_factory=list, compare=False, repr=False)

    def config(self) -> dict:
        return {"press": self.name, "budget": self.budget, "window": self.window}

    def compress(self, layer: LayerContext) -> CompressedLayer:
        self.seen.append(None if layer.roles is None else layer.roles.clone())
        return super().compress(layer)


def _answer(engine: RagSnapEngine, press: _SeesRoles, question: str) -> str:
    options = AnswerOptions(press=press, generation=GenerationConfig(max_new_tokens=2))
    return str(engine.answer(question, DOCS, options).stats.cache)


def test_every_answer_path_hands_the_prompts_roles_to_the_press(tmp_path) -> None:
    base = tiny_engine("llama")
    layout = base.build_prompt("t20 t21 t22", DOCS, GenerationConfig(max_new_tokens=2))
    expected = prompt_roles(base.tokenizer, layout)
    assert set(expected.tolist()) >= {1, 2, 3}  # the table has keys, values and delimiters
    press = _SeesRoles(budget=24, window=4)
    assert _answer(base, press, "t20 t21 t22") == "off"
    cached = RagSnapEngine(base.loaded, store=open_store(f"file://{tmp_path}"))
    assert _answer(cached, press, "t20 t21 t22") == "miss"
    other = cached.build_prompt("t23 t24", DOCS, GenerationConfig(max_new_tokens=2))
    assert _answer(cached, press, "t23 t24") == "prefix-hit"  # only the question is prefilled
    per_layer = len(press.seen) // 3
    for i, seen in enumerate(press.seen):
        want = expected if i < 2 * per_layer else prompt_roles(base.tokenizer, other)
        assert seen is not None and torch.equal(seen, want)


def test_the_role_press_changes_the_selection_only_where_there_is_structure() -> None:
    engine = tiny_engine("llama")
    layout = engine.build_prompt("t20 t21 t22", DOCS, GenerationConfig(max_new_tokens=2))
    roles = prompt_roles(engine.tokenizer, layout)
    snap = make_press("snapkv", budget=24, window=4)
    role_press = make_press("roles", budget=24, window=4)
    plain, by_role = engine.runtime.prefill_many(layout.input_ids, [snap, role_press], roles=roles)
    assert plain.kept_tokens_per_layer == by_role.kept_tokens_per_layer == [24] * 4
    assert any(
        not torch.equal(a.indices, b.indices) for a, b in zip(plain.kept, by_role.kept, strict=True)
    )
    prose_roles = torch.where(
        roles == TokenRole.INSTRUCTION, roles, torch.zeros_like(roles)
    )  # structure removed
    plain, by_role = engine.runtime.prefill_many(
        layout.input_ids, [snap, role_press], roles=prose_roles
    )
    assert all(
        torch.equal(a.indices, b.indices) for a, b in zip(plain.kept, by_role.kept, strict=True)
    )
