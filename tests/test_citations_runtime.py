"""Attribution through the runtime on tiny random models: the recomputed answer attention,
every press, marker control while decoding, and the streamed text left untouched."""

from __future__ import annotations

import itertools

import pytest
import torch

from ragsnap.citations.attribution import AttributionWeights
from ragsnap.citations.markers import MarkerConstraint
from ragsnap.citations.options import CitationOptions
from ragsnap.compression import PRESSES, make_press
from ragsnap.engine.engine import AnswerOptions
from ragsnap.engine.events import CitationsEvent, DoneEvent, MetaEvent, TokenEvent
from ragsnap.prompt.documents import Document
from ragsnap.runtime.generation import GenerationConfig
from tests.tiny_models import VOCAB, random_prompt, tiny_engine, tiny_model

DOCS = [
    Document(
        id=f"d{i}", title=f"t{10 + i}", text=" ".join(f"t{(7 * i + j) % 90 + 2}" for j in range(40))
    )
    for i in range(3)
]


def test_answer_attention_with_a_full_cache_equals_eager_attention_weights() -> None:
    engine = tiny_engine("llama", attn="eager")
    prompt, answer = random_prompt(40, seed=1), random_prompt(6, seed=2)
    prefill = engine.runtime.prefill(prompt, make_press("full"))
    got = engine.runtime.answer_attention(prefill, answer)  # [6, 40]
    model = tiny_model("llama", attn="eager")
    with torch.no_grad():
        out = model(torch.tensor([prompt + answer]), output_attentions=True)
    # layers x heads mean of the answer queries' weights on the prompt positions
    expected = torch.stack(out.attentions)[:, 0, :, 40:, :40].mean(dim=(0, 1))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def test_answer_attention_of_chosen_layers_stops_early_and_sees_only_kept_positions() -> None:
    engine = tiny_engine("llama")
    prompt, answer = random_prompt(80, seed=3), random_prompt(5, seed=4)
    prefill = engine.runtime.prefill(prompt, make_press("snapkv", budget=24, window=8))
    got = engine.runtime.answer_attention(prefill, answer, layers=[0, 1])
    assert got.shape == (5, 80)
    kept = set(prefill.kept[0].indices.flatten().tolist()) | set(
        prefill.kept[1].indices.flatten().tolist()
    )
    dropped = [p for p in range(80) if p not in kept]
    assert dropped and float(got[:, dropped].abs().sum()) == 0.0
    # mass on the prompt plus mass on the answer's own tokens is 1 per query
    assert bool((got.sum(dim=1) <= 1.0 + 1e-5).all()) and float(got.sum()) > 0.5


# weights that use attention evidence (the defaults do not, and skip its pass)
WITH_ATTENTION = AttributionWeights(overlap=0.3, attention=0.3, question=0.4, threshold=0.35)


@pytest.mark.parametrize("press", sorted(PRESSES))
def test_attribution_runs_with_every_press_and_a_budget_above_the_prompt(press) -> None:
    engine = tiny_engine("llama")
    for budget, weights in itertools.product((48, 4096), (AttributionWeights(), WITH_ATTENTION)):
        # compressed, and a budget above the prompt (nothing dropped)
        options = AnswerOptions(
            press=make_press(press, budget=budget, window=8)
            if press != "full"
            else make_press("full"),
            generation=GenerationConfig(max_new_tokens=6),
            citations=CitationOptions(inline_markers=True, weights=weights),
        )
        events = list(engine.stream("t5 t6 t7", DOCS, options))
        meta, done = events[0], events[-1]
        assert isinstance(meta, MetaEvent) and isinstance(done, DoneEvent)
        assert done.stats.citations_mode == "attribution" and done.stats.attribution_s > 0
        in_prompt = {d["index"]: d["id"] for d in meta.documents}  # [n] as the model saw it
        for citation in done.citations:
            doc = next(d for d in DOCS if d.id == citation.doc_id)
            assert in_prompt[citation.index] == doc.id and citation.supported is not None
            for quote in citation.quotes:
                assert doc.text[quote.start : quote.end] == quote.text
                assert quote.kept_share is None or 0.0 <= quote.kept_share <= 1.0
        assert done.answer_with_markers is not None


def test_the_attention_pass_runs_only_for_weights_that_use_attention() -> None:
    engine = tiny_engine("llama")
    calls = []
    recompute = engine.runtime.answer_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return recompute(*args, **kwargs)

    engine.runtime.answer_attention = counted
    for weights, expected in ((AttributionWeights(), 0), (WITH_ATTENTION, 1)):
        calls.clear()
        options = AnswerOptions(
            press=make_press("snapkv", budget=48, window=8),
            generation=GenerationConfig(max_new_tokens=4),
            citations=CitationOptions(weights=weights),
        )
        engine.answer("t5 t6 t7", DOCS, options)
        assert len(calls) == expected


def test_marker_control_never_lets_an_out_of_range_number_follow_an_open_bracket() -> None:
    engine = tiny_engine("llama")
    texts = [f" w{i}" for i in range(VOCAB)]
    texts[10], texts[11], texts[12], texts[19], texts[20] = "[", "1", "2", "9", "]"
    constraint = MarkerConstraint(texts, count=2)

    def push_for_nine(tokens: list[int], logits: torch.Tensor) -> torch.Tensor:
        logits = logits.clone()
        logits[0, 19] = 1e4  # the model "wants" [9]
        if not tokens or tokens[-1] == 20:
            logits[0, 10] = 2e4  # and opens a marker after every closing one
        return constraint(tokens, logits)

    prefill = engine.runtime.prefill(random_prompt(30, seed=5), make_press("full"))
    batch = engine.runtime.decode_batch(stop_ids=set())
    row = batch.add(0, prefill, GenerationConfig(max_new_tokens=12), logits_processor=push_for_nine)
    for _ in batch.run():
        pass
    text = "".join(texts[t] for t in row.tokens)
    assert text.startswith("[") and "9" not in text  # 9 was the favourite, never allowed
    assert "]" in text or "1" in text or "2" in text
    unconstrained = engine.runtime.decode_batch(stop_ids=set())
    free = unconstrained.add(
        0, prefill, GenerationConfig(max_new_tokens=4), logits_processor=_boost
    )
    for _ in unconstrained.run():
        pass
    assert 19 in free.tokens  # without the constraint the model does write 9


def _boost(tokens: list[int], logits: torch.Tensor) -> torch.Tensor:
    logits = logits.clone()
    logits[0, 19] = 1e4
    return logits


def test_with_inline_markers_off_the_streamed_text_is_the_models_byte_for_byte() -> None:
    engine = tiny_engine("llama")
    options = AnswerOptions(
        press=make_press("snapkv", budget=48, window=8),
        generation=GenerationConfig(max_new_tokens=8),
        citations=CitationOptions(marker_control=False),
    )
    events = list(engine.stream("t5 t6 t7", DOCS, options))
    streamed = "".join(e.text for e in events if isinstance(e, TokenEvent))
    done = next(e for e in events if isinstance(e, DoneEvent))
    cites = next(e for e in events if isinstance(e, CitationsEvent))
    prepared = engine.prepare("t5 t6 t7", DOCS, options)
    tokens = engine.runtime.generate(prepared.prefill, options.generation)
    model_text = engine.tokenizer.decode(tokens, skip_special_tokens=True)
    assert streamed.encode() == model_text.encode() == done.answer.encode()
    assert done.answer_with_markers is None and cites.answer_with_markers is None
