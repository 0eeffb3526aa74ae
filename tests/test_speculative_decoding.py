"""Prompt-lookup speculation: greedy rows keep exactly the tokens plain decoding gives."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ragsnap.compression.decode_snapkv import DecodeSnapKV
from ragsnap.compression.lookahead import LookaheadPress
from ragsnap.compression.snapkv import SnapKVPress
from ragsnap.runtime.decode import DRAFT_PASS_TOKENS
from ragsnap.runtime.drafts import Drafts
from ragsnap.runtime.generation import GenerationConfig
from tests.test_runtime import REQUESTS, tiny_prefills
from tests.tiny_models import ARCHITECTURES, random_prompt, tiny_engine


def decode(runtime, requests, contexts, stop_ids=frozenset()):
    batch = runtime.decode_batch(set(stop_ids))
    rows = [
        batch.add(i, p, g, context=c)
        for i, ((p, g), c) in enumerate(zip(requests, contexts, strict=True))
    ]
    steps = 0
    while len(batch):
        batch.step()
        steps += 1
    return rows, steps


def test_lookup_drafts_what_followed_the_longest_latest_match() -> None:
    lookup = Drafts([5, 6, 7, 8, 9, 1, 6, 7, 3, 4], stop_ids={4})
    lookup.extend([6, 7])
    assert lookup.draft(4) == [3]  # the latest "6 7" was followed by 3, then the stop token
    lookup.extend([3])
    assert lookup.draft(2) == []  # "7 3" is followed by the stop token only
    lookup = Drafts([1, 2, 3, 4, 5, 9, 2, 3, 7])
    lookup.extend([1, 2, 3])
    assert lookup.draft(3) == [4, 5, 9]  # the trigram "1 2 3" wins over the later "2 3"
    assert lookup.draft(0) == [] and Drafts([1, 2]).draft(3) == []


def test_a_looping_answer_drafts_the_loop_past_the_context_end() -> None:
    lookup = Drafts([9, 8, 7])
    lookup.extend([5, 6, 1, 5, 6, 1, 5, 6])  # the answer repeats "5 6 1" (period 3)
    assert lookup.draft(7) == [1, 5, 6, 1, 5, 6, 1]  # not just the 1 token before the end
    lookup = Drafts([9, 8, 7], stop_ids={6})
    lookup.extend([5, 6, 1, 5, 6, 1, 5])
    assert lookup.draft(7) == []  # the loop goes on with the stop token: nothing drafted
    lookup.extend([2, 2, 2])  # period 1
    assert lookup.draft(4) == [2, 2, 2, 2]


def test_expected_tokens_lead_while_the_answer_agrees_with_them() -> None:
    lookup = Drafts([1, 2, 3, 1, 2, 5], expected=[7, 8, 9, 4])
    assert lookup.draft(2) == [7, 8]
    lookup.extend([7])
    assert lookup.draft(8) == [8, 9, 4]
    lookup.extend([8, 1, 2])  # the answer left the expected tokens: back to the n-grams
    assert lookup.draft(2) == [5, 7]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_speculating_rows_decode_exactly_as_plain_rows(arch) -> None:
    """With the plain answers in their contexts, drafts are right and kept; with the
    prompts alone, they are mostly wrong and thrown away: the tokens are the same."""
    engine = tiny_engine(arch)
    requests = tiny_prefills(engine)
    prompts = [random_prompt(length, seed=length) for length, _, _ in REQUESTS]
    plain, plain_steps = decode(engine.runtime, requests, prompts)
    answers = [row.tokens for row in plain]
    assert not any(row.proposed for row in plain)
    engine.runtime.speculate, engine.runtime.ngrams = 4, True
    for contexts in (prompts, [p + a for p, a in zip(prompts, answers, strict=True)]):
        rows, steps = decode(engine.runtime, requests, contexts)
        assert [row.tokens for row in rows] == answers
        assert all(row.accepted <= row.proposed for row in rows)
    # given the answers, most drafted tokens are right and the batch needs fewer steps
    assert sum(r.accepted for r in rows) > sum(len(a) for a in answers) / 2
    assert steps < plain_steps
    assert all(row.steps < len(row.tokens) for row in rows)


def test_a_sampling_row_never_drafts_and_a_drafting_row_stops_at_its_length() -> None:
    engine = tiny_engine("llama")
    engine.runtime.speculate = 8
    ((prefill, _),) = tiny_prefills(engine)[:1]
    prompt = random_prompt(REQUESTS[0][0], seed=REQUESTS[0][0])
    greedy = GenerationConfig(max_new_tokens=5)
    plain = engine.runtime.decode_batch(set())
    answer = plain.add(0, prefill, GenerationConfig(max_new_tokens=30))
    while len(plain):
        plain.step()
    rows, _ = decode(
        engine.runtime,
        [(prefill, greedy), (prefill, GenerationConfig(max_new_tokens=5, temperature=0.8, seed=1))],
        [prompt + answer.tokens] * 2,
    )
    assert rows[0].tokens == answer.tokens[:5] and rows[0].finish_reason == "length"
    assert rows[1].proposed == 0 and len(rows[1].tokens) == 5


def lossless_lookahead(engine):
    """A 60-token prompt prefilled with a 6-token lookahead at a budget above its length (the
    compressed cache is the full one), and its plain greedy decode of 10 tokens."""
    prompt = random_prompt(60, seed=2)
    prefill = engine.runtime.prefill(
        prompt, LookaheadPress(SnapKVPress(budget=64, window=8), tokens=6)
    )
    generation = GenerationConfig(max_new_tokens=10)
    (plain,), steps = decode(engine.runtime, [(prefill, generation)], [prompt])
    return prompt, prefill, generation, plain, steps


def test_a_lookahead_draft_is_the_first_guess_and_kept_where_the_cache_lost_nothing() -> None:
    engine = tiny_engine("llama")
    prompt, prefill, generation, plain, _ = lossless_lookahead(engine)
    assert len(prefill.draft) == 6 and plain.tokens[:6] == prefill.draft
    engine.runtime.speculate = 8  # no n-grams: the lookahead's tokens alone
    (row,), steps = decode(engine.runtime, [(prefill, generation)], [prompt])
    assert row.tokens == plain.tokens
    assert row.accepted >= 5  # the first step kept the five drafted tokens after its own
    assert steps <= len(plain.tokens) - 4


@pytest.mark.model
def test_the_embedded_model_keeps_drafts_of_a_copied_answer_and_answers_the_same(engine) -> None:
    from ragsnap.compression import make_press
    from ragsnap.engine.engine import AnswerOptions
    from ragsnap.prompt.documents import Document

    documents = [
        Document(
            id="stone",
            title="Rosetta Stone",
            text="The Rosetta Stone has been on public display at the British Museum in "
            "London since 1802, where it is the most visited object in the collection.",
        )
    ]
    question = "Where is the Rosetta Stone on display, and since when?"
    options = AnswerOptions(
        press=make_press("snapkv", budget=64), generation=GenerationConfig(max_new_tokens=40)
    )
    plain = engine.answer(question, documents, options)
    engine.runtime.speculate, engine.runtime.ngrams = 4, True
    try:
        drafted = engine.answer(question, documents, options)
    finally:
        engine.runtime.speculate, engine.runtime.ngrams = 0, False
    assert drafted.answer == plain.answer
    assert plain.stats.drafts_proposed == 0
    assert 0 < drafted.stats.drafts_kept <= drafted.stats.drafts_proposed


def test_a_pass_feeds_at_most_its_token_budget_of_drafts() -> None:
    engine = tiny_engine("llama")
    prefill, generation = tiny_prefills(engine)[0]
    (plain,), _ = decode(engine.runtime, [(prefill, generation)], [()])
    engine.runtime.speculate = 8
    expected = replace(prefill, draft=plain.tokens)  # every draft is right
    for rows in (1, 2, DRAFT_PASS_TOKENS // 2 + 1):
        batch = engine.runtime.decode_batch(set())
        added = [batch.add(i, expected, generation) for i in range(rows)]
        batch.step()  # the first tokens, and the drafts after them
        most = min(8, DRAFT_PASS_TOKENS // rows - 1)
        assert all(row.proposed == max(0, most) for row in added)
        assert all(len(row.tokens) == 1 + max(0, most) for row in added)


def test_a_stop_rule_met_inside_a_kept_draft_ends_the_row_there() -> None:
    engine = tiny_engine("llama")
    prefill, generation = tiny_prefills(engine)[0]
    (plain,), _ = decode(engine.runtime, [(prefill, generation)], [()])
    engine.runtime.speculate = 8
    batch = engine.runtime.decode_batch(set())
    row = batch.add(
        0, replace(prefill, draft=plain.tokens), generation, lambda tokens: len(tokens) >= 3
    )
    outputs = batch.step()  # the first token and its (right) draft in one pass
    assert row.tokens == plain.tokens[:3] and row.finish_reason == "stop"
    assert [o.token for o in outputs] == plain.tokens[:3]
    assert [o.finish_reason for o in outputs] == [None, None, "stop"] and not len(batch)


def test_metrics_count_the_drafted_tokens_fed_and_kept() -> None:
    from ragsnap.api.metrics import ServiceMetrics
    from ragsnap.engine.stats import AnswerStats

    metrics = ServiceMetrics()
    fields = {
        f: 0 for f in AnswerStats.__dataclass_fields__ if f not in {"model", "device", "press"}
    }
    fields.update(press_config={}, kept_tokens_per_layer=[], budget=None, citations_mode="markers")
    fields.update(cache="hit", cache_tier="exact", decode_ms_per_token=None)
    metrics.observe_answer(AnswerStats(model="m", device="cpu", press="snapkv", **fields))
    fields.update(drafts_proposed=8, drafts_kept=6)
    metrics.observe_answer(AnswerStats(model="m", device="cpu", press="snapkv", **fields))
    text = metrics.render().decode()
    assert 'ragsnap_decode_draft_tokens_total{outcome="proposed"} 8.0' in text
    assert 'ragsnap_decode_draft_tokens_total{outcome="kept"} 6.0' in text


def test_a_committed_lookahead_draft_opens_the_answer_in_one_pass_unchecked() -> None:
    engine = tiny_engine("llama")
    prompt, prefill, generation, plain, plain_steps = lossless_lookahead(engine)
    engine.runtime.commit_drafts = True
    try:
        (row,), steps = decode(engine.runtime, [(prefill, generation)], [prompt])
        assert row.tokens == plain.tokens and steps == plain_steps - 5
        # a draft plain decoding would not give is kept all the same, by every row of a
        # batch larger than the pass budget allows drafts for, each in one pass
        wrong = [plain.tokens[0], *(t + 1 for t in plain.tokens[1:6])]
        rows = DRAFT_PASS_TOKENS
        batch = engine.runtime.decode_batch(set())
        added = [batch.add(i, replace(prefill, draft=wrong), generation) for i in range(rows)]
        outputs = batch.step()
        assert all(row.tokens == wrong for row in added) and len(outputs) == 6 * rows
        # rows that sample or constrain their logits decode every token themselves
        sampled = GenerationConfig(max_new_tokens=10, temperature=0.8, seed=1)
        batch = engine.runtime.decode_batch(set())
        kept = replace(prefill, draft=wrong)
        sampling = batch.add(0, kept, sampled)
        constrained = batch.add(1, kept, generation, logits_processor=lambda _t, logits: logits)
        batch.step()
        assert len(sampling.tokens) == 1 and constrained.tokens == plain.tokens[:1]
        # a stop rule met inside the committed draft ends the row there
        batch = engine.runtime.decode_batch(set())
        stopped = batch.add(0, kept, generation, lambda tokens: len(tokens) >= 3)
        batch.step()
        assert stopped.tokens == wrong[:3] and stopped.finish_reason == "stop"
        # beside a row that records its attention (one token a step for all), a committing
        # row takes its draft a token a step: the same answer as in a batch of its own
        alone, _ = decode(engine.runtime, [(kept, generation)], [prompt])
        batch = engine.runtime.decode_batch(set())
        beside = batch.add(0, kept, generation)
        batch.add(1, prefill, generation, decode_compression=DecodeSnapKV(slack=8, window=4))
        for _ in batch.run():
            pass
        assert beside.tokens == alone[0].tokens and beside.tokens[:6] == wrong
    finally:
        engine.runtime.commit_drafts = False
