"""The role-conditioned press: exact budget, per-role shares, redistribution, prose unchanged."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from ragsnap.compression import Press, compression_hooks, make_press
from ragsnap.compression.base import CompressedLayer, LayerContext, keep_all
from ragsnap.compression.role_budget import ROLES, allocate_quotas, reach_back
from ragsnap.compression.roles import TokenRole
from ragsnap.compression.snapkv import SnapKVPress
from ragsnap.errors import ConfigError
from tests.tiny_models import random_prompt, tiny_engine

V, D, OT, W, K = (int(r) for r in ROLES)
LENGTH, WINDOW, BUDGET = 100, 8, 40


class _RecordScores(Press):
    """Keeps everything; remembers SnapKV's scores of every layer."""

    name = "record"

    def __init__(self) -> None:
        self.snap = SnapKVPress(budget=BUDGET, window=WINDOW)
        self.scores: dict[int, torch.Tensor] = {}

    def compress(self, layer: LayerContext) -> CompressedLayer:
        self.scores[layer.layer_idx] = self.snap.score(layer)
        return keep_all(layer)


def _run(press: Press, roles: torch.Tensor | None, seed: int = 5):
    engine = tiny_engine("llama")
    recorder_press = _RecordScores()
    prompt = random_prompt(LENGTH, seed=seed)
    cache = engine.runtime.new_cache()
    with compression_hooks(
        engine.loaded.model, [press, recorder_press], apply=False, roles=roles
    ) as rec:
        rec.armed = True
        engine.runtime.forward(prompt, cache, 0)
    return rec.layer_results(0), recorder_press.scores


def _roles(pattern: list[int]) -> torch.Tensor:
    return torch.tensor((pattern * LENGTH)[:LENGTH], dtype=torch.uint8)


def test_quotas_follow_the_shares_and_redistribute_what_a_role_cannot_use() -> None:
    shares = [0.70, 0.20, 0.05, 0.05, 0.0]  # VALUE, DELIM, OTHER, WS, KEY
    # 32 slots: 22.4 / 6.4 / 1.6 / 1.6 -> floors 22, 6, 1, 1; the two largest remainders
    # (OTHER and WS, 0.6 each) get the last two slots
    assert allocate_quotas([50, 50, 50, 50, 50], shares, 32) == [22, 6, 2, 2, 0]
    # only 5 values: the other 27 slots go 0.2 : 0.05 : 0.05 -> 18, 4.5, 4.5 -> 18, 5, 4
    assert allocate_quotas([5, 50, 50, 50, 50], shares, 32) == [5, 18, 5, 4, 0]
    # zero-share keys get slots only once every other role is exhausted
    assert allocate_quotas([2, 2, 2, 2, 50], shares, 12) == [2, 2, 2, 2, 4]
    # a role without tokens hands its whole share on
    assert allocate_quotas([0, 50, 50, 50, 50], shares, 30) == [0, 20, 5, 5, 0]
    assert sum(allocate_quotas([7, 3, 9, 1, 4], [0.3, 0.3, 0.2, 0.1, 0.1], 20)) == 20


def test_role_press_keeps_the_budget_and_each_roles_share_of_the_best_tokens() -> None:
    roles = _roles([V, V, V, D, OT, W, K])
    press = make_press("roles", budget=BUDGET, window=WINDOW, key_share=0.0)
    results, scores = _run(press, roles)
    prefix = LENGTH - WINDOW
    for layer_idx, layer in enumerate(results):
        assert layer.indices.shape[-1] == BUDGET  # exactly the budget, every layer and head
        for head, kept in enumerate(layer.indices[0]):
            kept_list = kept.tolist()
            assert kept_list[-WINDOW:] == list(range(prefix, LENGTH))  # the window
            counts = Counter(int(roles[p]) for p in kept_list[:-WINDOW])
            assert [counts.get(r, 0) for r in (V, D, OT, W, K)] == [22, 6, 2, 2, 0]
            head_scores = scores[layer_idx][0, head]
            for role in (V, D, OT, W):  # inside a role: SnapKV's best scores of that role
                members = [float(head_scores[p]) for p in range(prefix) if int(roles[p]) == role]
                best = sorted(members, reverse=True)[: counts[role]]  # ties: max pooling
                mine = [float(head_scores[p]) for p in kept_list[:-WINDOW] if int(roles[p]) == role]
                assert sorted(mine, reverse=True) == best


def test_role_press_redistributes_the_share_a_saturated_role_leaves() -> None:
    roles = _roles([D, OT, W, D, OT, W, K, D])
    roles[10:15] = V  # only five values in the prompt
    press = make_press("roles", budget=BUDGET, window=WINDOW, key_share=0.0)
    results, _ = _run(press, roles)
    for layer in results:
        assert layer.indices.shape[-1] == BUDGET
        for kept in layer.indices[0]:
            counts = Counter(int(roles[p]) for p in kept.tolist()[:-WINDOW])
            assert [counts.get(r, 0) for r in (V, D, OT, W, K)] == [5, 18, 5, 4, 0]


@pytest.mark.parametrize("roles_kind", ["none", "prose"])
def test_prose_prompts_compress_exactly_as_the_wrapped_press(roles_kind: str) -> None:
    roles = None
    if roles_kind == "prose":
        roles = torch.zeros(LENGTH, dtype=torch.uint8)
        roles[:6] = TokenRole.INSTRUCTION
    snap, _ = _run(make_press("snapkv", budget=BUDGET, window=WINDOW), roles)
    wrapped, _ = _run(make_press("roles", budget=BUDGET, window=WINDOW), roles)
    for a, b in zip(snap, wrapped, strict=True):
        assert torch.equal(a.indices, b.indices)
    default, _ = _run(make_press("ragsnap", budget=BUDGET, window=WINDOW), roles)
    composed, _ = _run(make_press("ragsnap-roles", budget=BUDGET, window=WINDOW), roles)
    for a, b in zip(default, composed, strict=True):
        assert torch.equal(a.indices, b.indices) and torch.equal(a.values, b.values)
        assert a.bias is not None and b.bias is not None and torch.equal(a.bias, b.bias)


def test_roles_compose_with_the_default_press_on_structured_prompts() -> None:
    roles = _roles([V, V, V, D, OT, W, K])
    composed, _ = _run(make_press("ragsnap-roles", budget=BUDGET, window=WINDOW), roles)
    default, _ = _run(make_press("ragsnap", budget=BUDGET, window=WINDOW), roles)
    values = int(TokenRole.VALUE)
    for mine, theirs in zip(composed, default, strict=True):
        assert mine.indices.shape == theirs.indices.shape  # same cache size per layer
        assert mine.bias is not None  # Attention Matching still refits what was kept
        share = (roles[mine.indices[0, :, :-WINDOW]] == values).float().mean()
        assert 0.6 <= float(share) <= 0.72  # about 0.70 / 1.10 of the slots, after completion


def test_role_shares_are_validated() -> None:
    with pytest.raises(ConfigError):
        make_press("roles", budget=64, value_share=-0.1)
    with pytest.raises(ConfigError):
        make_press("roles", budget=64, value_share=0, delim_share=0, other_share=0, ws_share=0,
                   key_share=0)  # fmt: skip
    config = make_press("roles", budget=64, key_share=0.2).config()
    assert config["press"] == "roles" and config["key_share"] == 0.2


def test_reach_back_ranks_a_token_by_the_best_score_just_before_it() -> None:
    scores = torch.tensor([[[0.1, 0.9, 0.2, 0.3, 0.0, 0.5, 0.1]]])
    assert torch.equal(reach_back(scores, 0), scores)
    expected = torch.tensor([[[0.1, 0.9, 0.9, 0.9, 0.3, 0.5, 0.5]]])
    assert torch.equal(reach_back(scores, 2), expected)


def test_reach_back_keeps_the_budget_and_the_shares_and_reaches_values_after_keys() -> None:
    roles = _roles([V, V, V, D, OT, W, K])
    press = make_press("roles", budget=BUDGET, window=WINDOW, key_share=0.0, reach_back=6)
    plain = make_press("roles", budget=BUDGET, window=WINDOW, key_share=0.0)
    results, _ = _run(press, roles)
    baseline, _ = _run(plain, roles)
    changed = 0
    for layer, other in zip(results, baseline, strict=True):
        assert layer.indices.shape[-1] == BUDGET
        for kept in layer.indices[0]:
            counts = Counter(int(roles[p]) for p in kept.tolist()[:-WINDOW])
            assert [counts.get(r, 0) for r in (V, D, OT, W, K)] == [22, 6, 2, 2, 0]
        changed += int(not torch.equal(layer.indices, other.indices))
    assert changed > 0  # the ranking inside roles did change
    with pytest.raises(ConfigError):
        make_press("roles", budget=64, reach_back=-1)
