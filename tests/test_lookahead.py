"""Lookahead votes: answer tokens drafted on the full cache vote beside the window.

Checked against the loop reference of ``test_snapkv_reference``: the draft is a plain
greedy loop over whole sequences (no cache), the drafted tokens' queries come from a plain
forward over prompt + draft, and each drafted query's softmax runs over the prompt's keys.
"""

from __future__ import annotations

import pytest
import torch

from ragsnap.compression import DEFAULT_PRESS, H2OPress, LookaheadPress, SnapKVPress, make_press
from ragsnap.compression.lookahead import lookahead_tokens
from ragsnap.errors import ConfigError
from ragsnap.prompt.documents import Document
from ragsnap.runtime.prefill import draft_queries, drain, forward_chunk
from tests.test_snapkv_reference import (
    assert_same_selection,
    reference_run,
    reference_snapkv,
    reference_window_queries,
    softmax_scale,
)
from tests.tiny_models import KV_HEADS, random_prompt, tiny_engine

PROMPT_LEN, WINDOW, BUDGET, AHEAD = 96, 8, 40, 5


def greedy(model, ids: list[int], tokens: int, stop: set[int]) -> list[int]:
    """A plain greedy loop over whole sequences, stopping before a ``stop`` token."""
    drafted: list[int] = []
    with torch.no_grad():
        for _ in range(tokens):
            logits = model(input_ids=torch.tensor([ids + drafted])).logits[0, -1]
            token = int(logits.argmax())
            if token in stop:
                break
            drafted.append(token)
    return drafted


def drafted_votes(queries: torch.Tensor, keys: torch.Tensor, prefix: int, scale: float):
    """``[Hkv, prefix]``: each drafted query's softmax over every prompt key, summed over
    the queries and averaged over each KV head's query heads (``queries``: ``[Hq, k, D]``)."""
    group = queries.shape[0] // keys.shape[0]
    votes = torch.zeros(keys.shape[0], prefix)
    for kv_head in range(keys.shape[0]):
        for g in range(group):
            for row in queries[kv_head * group + g]:
                probs = torch.softmax((keys[kv_head].float() @ row) * scale, dim=0)
                votes[kv_head] += probs[:prefix] / group
    return votes


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_drafted_tokens_vote_as_the_reference_says(arch: str) -> None:
    engine = tiny_engine(arch, "sdpa", seed=4)
    model, prompt = engine.loaded.model, random_prompt(PROMPT_LEN, seed=5)
    engine.runtime.stop_ids = set()  # a full draft whatever the random model writes
    press = LookaheadPress(SnapKVPress(budget=BUDGET, window=WINDOW, kernel=1), tokens=AHEAD)
    result = engine.runtime.prefill(prompt, press)
    plain = engine.runtime.prefill(prompt, press.base)

    draft = greedy(model, prompt, AHEAD, set())
    hidden, cache = reference_run(model, prompt + draft)
    prefix = PROMPT_LEN - WINDOW
    differs = False
    for layer_idx, (kept, base) in enumerate(zip(result.kept, plain.kept, strict=True)):
        queries = reference_window_queries(model, layer_idx, hidden[layer_idx], WINDOW + AHEAD)
        keys = cache.layers[layer_idx].keys[0, :, :PROMPT_LEN]  # the prompt's keys only
        scale = softmax_scale(model)
        ref = reference_snapkv(queries[:, :WINDOW], keys, WINDOW, BUDGET, 1, "max", scale)
        ref += drafted_votes(queries[:, WINDOW:], keys, prefix, scale)
        assert_same_selection(kept.indices[0], ref, WINDOW, BUDGET)
        differs |= not torch.equal(kept.indices, base.indices)
        # the draft's KV is gone: kept entries are the prompt's own
        idx = kept.indices[0]
        stored = result.cache.layers[layer_idx]
        assert stored.keys.shape == (1, KV_HEADS, BUDGET, 16)
        for head in range(KV_HEADS):
            torch.testing.assert_close(stored.keys[0, head], keys[head, idx[head]])
            values = cache.layers[layer_idx].values[0, head, :PROMPT_LEN]
            torch.testing.assert_close(stored.values[0, head], values[idx[head]])
    assert differs, "the drafted votes changed no layer's selection: the case tests nothing"
    torch.testing.assert_close(result.next_logits, plain.next_logits)
    assert result.original_length == PROMPT_LEN
    assert (result.drafted_tokens, plain.drafted_tokens) == (AHEAD, 0)


def test_the_draft_stops_before_an_end_token_and_returns_its_queries() -> None:
    engine = tiny_engine("llama", "sdpa", seed=4)
    model, prompt = engine.loaded.model, random_prompt(PROMPT_LEN, seed=5)
    draft = greedy(model, prompt, AHEAD, set())
    runtime = engine.runtime
    cache = runtime.new_cache()
    logits = forward_chunk(model, runtime.cache_kwarg, prompt, cache, 0)
    drafted, tokens = drain(
        draft_queries(
            model, runtime.cache_kwarg, cache, logits, PROMPT_LEN, AHEAD, stop_ids={draft[2]}
        )
    )
    assert cache.get_seq_length() == PROMPT_LEN + 2  # two tokens drafted, then the stop
    assert tokens == draft[:2]
    hidden, _ = reference_run(model, prompt + draft[:2])
    for layer_idx, queries in drafted.items():
        expected = reference_window_queries(model, layer_idx, hidden[layer_idx], 2)
        torch.testing.assert_close(queries[0], expected, rtol=1e-4, atol=1e-5)


def test_when_the_answer_ends_at_once_nothing_is_drafted_and_the_base_press_decides() -> None:
    engine = tiny_engine("llama", "sdpa", seed=4)
    prompt = random_prompt(PROMPT_LEN, seed=5)
    first = greedy(engine.loaded.model, prompt, 1, set())[0]
    base = SnapKVPress(budget=BUDGET, window=WINDOW)
    engine.runtime.stop_ids = {first}
    result = engine.runtime.prefill(prompt, LookaheadPress(base, tokens=AHEAD))
    plain = engine.runtime.prefill(prompt, base)
    assert result.drafted_tokens == 0
    for kept, expected in zip(result.kept, plain.kept, strict=True):
        assert torch.equal(kept.indices, expected.indices)
        torch.testing.assert_close(kept.values, expected.values)


def test_a_model_with_sliding_layers_is_compressed_by_the_base_press_alone() -> None:
    engine = tiny_engine("gemma3", "sdpa", seed=4)
    prompt = random_prompt(PROMPT_LEN, seed=5)
    base = SnapKVPress(budget=BUDGET, window=WINDOW)
    result = engine.runtime.prefill(prompt, LookaheadPress(base, tokens=AHEAD))
    plain = engine.runtime.prefill(prompt, base)
    assert len(result.kept) == len(plain.kept) == 2  # the two global layers
    for kept, expected in zip(result.kept, plain.kept, strict=True):
        assert torch.equal(kept.indices, expected.indices)


def test_lookahead_is_part_of_the_press_config_and_checked() -> None:
    press = make_press("ragsnap", budget=64, lookahead=4)
    assert isinstance(press, LookaheadPress) and press.tokens == 4
    assert press.config() == {**make_press("ragsnap", budget=64).config(), "lookahead": 4}
    default = make_press(DEFAULT_PRESS, budget=64)
    assert isinstance(default, LookaheadPress) and default.config()["lookahead"] == 8
    assert (
        make_press(DEFAULT_PRESS, budget=64, lookahead=0).config()
        == make_press("ragsnap", budget=64).config()
    )  # 0 turns it off
    focused = make_press(DEFAULT_PRESS, budget=64, lookahead=3, lookup=True)
    assert lookahead_tokens(focused) == 3 and focused.config()["lookahead"] == 3  # one wrapper
    for build in (
        lambda: LookaheadPress(SnapKVPress(), tokens=0),
        lambda: LookaheadPress(SnapKVPress(), tokens=65),
        lambda: LookaheadPress(H2OPress(budget=64)),
    ):
        with pytest.raises(ConfigError) as caught:
            build()
        assert caught.value.field == "lookahead"


def test_a_prefix_hit_looks_ahead_as_a_cold_prefill_does() -> None:
    """The question tail prefilled over a reused document prefix drafts the same tokens and
    keeps the same entries as the whole prompt prefilled cold."""
    engine = tiny_engine("llama", "sdpa", seed=4)
    engine.runtime.stop_ids = set()
    runtime, prompt = engine.runtime, random_prompt(PROMPT_LEN, seed=5)
    press = LookaheadPress(SnapKVPress(budget=BUDGET, window=WINDOW), tokens=AHEAD)
    cold = runtime.prefill(prompt, press)
    prefix = runtime.cache_from(runtime.prefill_full(prompt[:60]))
    warm = runtime.prefill(prompt, press, cache=prefix, start=60)
    assert cold.drafted_tokens == warm.drafted_tokens == AHEAD and cold.draft == warm.draft
    assert warm.processed_tokens == PROMPT_LEN - 60
    for a, b in zip(cold.kept, warm.kept, strict=True):
        assert torch.equal(a.indices, b.indices)
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-4, atol=1e-5)


def test_the_engine_reports_the_drafted_tokens_and_keys_the_press_by_them(engine) -> None:
    from ragsnap.engine.engine import AnswerOptions
    from ragsnap.prompt.documents import Document
    from ragsnap.runtime.generation import GenerationConfig

    docs = [Document(id="tides", title="Tides", text="Tides are caused by the Moon's gravity.")]
    generation = GenerationConfig(max_new_tokens=8)
    ahead = engine.answer(
        "What causes tides?",
        docs,
        AnswerOptions(
            press=make_press("snapkv", budget=48, window=8, lookahead=4), generation=generation
        ),
    )
    plain = engine.answer(
        "What causes tides?",
        docs,
        AnswerOptions(press=make_press("snapkv", budget=48, window=8), generation=generation),
    )
    assert 1 <= ahead.stats.drafted_tokens <= 4 and plain.stats.drafted_tokens == 0
    assert (
        ahead.stats.press_config["lookahead"] == 4 and "lookahead" not in plain.stats.press_config
    )
    assert ahead.stats.kept_tokens == plain.stats.kept_tokens == 48


def test_the_service_drafts_with_its_default_press_and_not_when_told(engine) -> None:
    from ragsnap.api.app import create_app
    from ragsnap.api.settings import Settings
    from tests.api_helpers import DOCS
    from tests.local_client import LocalClient

    body = {"question": "What causes tides?", "documents": DOCS, "max_new_tokens": 4}
    stats = {}
    for default in ("ragsnap-lookahead", "ragsnap"):
        with LocalClient(create_app(Settings(default_press=default), engine=engine)) as client:
            plain = client.post("/v1/answer", json={**body, "compression": {"budget": 64}})
            off = client.post(
                "/v1/answer", json={**body, "compression": {"budget": 64, "lookahead": 0}}
            )
        assert plain.status_code == off.status_code == 200, plain.text
        stats[default] = plain.json()["stats"]
        assert off.json()["stats"]["drafted_tokens"] == 0
    assert stats["ragsnap-lookahead"]["drafted_tokens"] > 0
    assert stats["ragsnap-lookahead"]["press_config"]["lookahead"] == 8
    assert stats["ragsnap"]["drafted_tokens"] == 0
    assert stats["ragsnap"]["press"] == "ragsnap"
    assert stats["ragsnap-lookahead"]["press"] == "ragsnap-lookahead"  # as the README names it


def test_a_press_that_scores_every_query_still_sees_them_all_beside_a_lookahead() -> None:
    """One prefill for several presses (as ``ragsnap eval`` runs them): H2O keeps what it
    keeps alone, although the lookahead press beside it cut the cache back after its draft."""
    engine = tiny_engine("llama", "sdpa", seed=4)
    engine.runtime.stop_ids = set()
    prompt = random_prompt(PROMPT_LEN, seed=5)
    h2o = H2OPress(budget=BUDGET)
    alone = engine.runtime.prefill_many(prompt, [h2o])[0]
    beside = engine.runtime.prefill_many(
        prompt, [h2o, LookaheadPress(SnapKVPress(budget=BUDGET, window=WINDOW), tokens=AHEAD)]
    )
    assert beside[1].drafted_tokens == AHEAD
    for a, b in zip(alone.kept, beside[0].kept, strict=True):
        assert torch.equal(a.indices, b.indices)


def _drafts_both_ways(model, kwarg, prompt, tokens=8):
    """(queries, tokens, cache, tokens fed per pass) of the one-token draft and of the
    draft guessed from ``prompt``."""
    from transformers import DynamicCache

    out = []
    for context in ((), prompt):
        cache = DynamicCache(config=model.config)
        logits = forward_chunk(model, kwarg, prompt, cache, 0)
        steps = draft_queries(model, kwarg, cache, logits, len(prompt), tokens, set(), context)
        fed: list[int] = []
        try:
            while True:
                fed.append(len(next(steps).ids))
        except StopIteration as finished:
            queries, drafted = finished.value
        out.append((queries, drafted, cache, fed))
    return out


def _same_draft(plain, guessed, length) -> None:
    (q1, t1, c1, _), (q2, t2, c2, _) = plain, guessed
    assert t2 == t1
    assert c2.get_seq_length() == c1.get_seq_length() == length + len(t1)
    for layer in q1:
        torch.testing.assert_close(q2[layer], q1[layer], atol=1e-4, rtol=1e-4)
    end = length + len(t1)
    for one, two in zip(c1.layers, c2.layers, strict=True):
        torch.testing.assert_close(two.keys[:, :, :end], one.keys[:, :, :end], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(
            two.values[:, :, :end], one.values[:, :, :end], atol=1e-4, rtol=1e-4
        )


def test_a_draft_with_rejected_guesses_is_the_one_token_draft() -> None:
    """Guesses from a repeating prompt that a tiny random model does not follow are fed and
    cut again: tokens, voting queries and cache are those of one-token passes."""
    from tests.tiny_models import tiny_engine

    engine = tiny_engine("llama")
    prompt = [5 + (i % 11) for i in range(66)]
    plain, guessed = _drafts_both_ways(engine.loaded.model, engine.loaded.cache_kwarg, prompt)
    assert plain[3] == [1] * 8 and max(guessed[3]) > 1  # guesses were fed
    _same_draft(plain, guessed, len(prompt))


def test_a_draft_in_the_lean_pass_is_the_module_trees(monkeypatch) -> None:
    """Draft passes left to the prefill run in the lean pass where the model has one: the
    tokens, voting queries and cache of the module tree's passes (float32)."""
    import ragsnap.runtime.prefill as prefill_module
    from ragsnap.runtime.llama_pass import LlamaPass

    engine = tiny_engine("llama")
    model, kwarg = engine.loaded.model, engine.loaded.cache_kwarg
    prompt = [5 + (i % 11) for i in range(66)]
    passes: list[int] = []
    real = LlamaPass.chunk
    monkeypatch.setattr(
        LlamaPass, "chunk", lambda self, feed: (passes.append(len(feed.ids)), real(self, feed))
    )
    lean = _drafts_both_ways(model, kwarg, prompt)
    assert passes == lean[0][3] + lean[1][3]  # every pass of both drafts ran in it
    monkeypatch.setattr(prefill_module, "chunk_pass", lambda model: None)
    tree = _drafts_both_ways(model, kwarg, prompt)
    for (q1, t1, c1, f1), (q2, t2, c2, f2) in zip(tree, lean, strict=True):
        assert t2 == t1 and f2 == f1 and sorted(q2) == sorted(q1)
        for layer in q1:
            torch.testing.assert_close(q2[layer], q1[layer], atol=1e-5, rtol=1e-5)
        for a, b in zip(c1.layers, c2.layers, strict=True):
            torch.testing.assert_close(b.keys, a.keys, atol=1e-5, rtol=1e-5)


@pytest.mark.model
def test_a_draft_that_copies_the_prompt_takes_fewer_passes(engine) -> None:
    """The embedded model copying a name from its document: the guessed draft keeps
    guesses (fewer passes) and is the one-token draft (float32)."""
    from ragsnap.runtime.generation import GenerationConfig

    layout = engine.build_prompt(
        "What is the full name of the station's chief engineer?",
        [Document(id="1", text="The station's chief engineer is Margarethe Vollenweider-Okonkwo.")],
        GenerationConfig(max_new_tokens=8),
        order="given",
    )
    prompt = list(layout.input_ids)
    model, kwarg = engine.loaded.model, engine.loaded.cache_kwarg
    plain, guessed = _drafts_both_ways(model, kwarg, prompt)
    assert len(guessed[3]) < len(plain[3]) == len(plain[1])
    _same_draft(plain, guessed, len(prompt))


def test_a_draft_over_layers_holding_fewer_entries_than_positions_stays_in_the_tree() -> None:
    """A query-aware prefill keeps only the propagated tokens past its split: its draft's
    passes are not ridable and run through the module tree (whose masks count entries),
    and the lean pass refuses such a cache rather than attend by position."""
    from transformers import DynamicCache

    from ragsnap.runtime.llama_pass import ChunkFeed

    engine = tiny_engine("llama")
    model, kwarg = engine.loaded.model, engine.loaded.cache_kwarg
    prompt = random_prompt(40)
    cache = DynamicCache(config=model.config)
    logits = forward_chunk(model, kwarg, prompt, cache, 0)
    upper = cache.layers[-1]  # the last layer keeps 30 of the 40 positions
    upper.keys, upper.values = upper.keys[:, :, 10:], upper.values[:, :, 10:]
    steps = draft_queries(model, kwarg, cache, logits, len(prompt), 3, set())
    first = next(steps)
    assert not first.ridable
    queries, drafted = drain(steps)
    assert len(drafted) == 3 and queries[0].shape[2] == 3
    with pytest.raises(ValueError, match="holds 33 entries"):
        engine.runtime.lean.chunk(ChunkFeed([5], cache, len(prompt) + 3))
