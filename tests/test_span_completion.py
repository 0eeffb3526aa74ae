"""Word completion: boundaries from a real tokenizer, scores carried along words, whole words kept."""

from __future__ import annotations

import pytest
import torch

from ragsnap.compression import compression_hooks, make_press
from ragsnap.compression.words import carry_forward, segment_ids, word_starts
from tests.tiny_models import random_prompt, tiny_engine


@pytest.mark.model
def test_word_starts_follow_whitespace_on_the_embedded_tokenizer(engine) -> None:
    text = "The magic number is: 7007071.\nRemember it"
    ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = engine.tokenizer.convert_ids_to_tokens(ids)
    starts = word_starts(engine.tokenizer, ids).tolist()
    words, current = [], ""
    for piece, start in zip(pieces, starts, strict=True):
        if start and current:
            words.append(current)
            current = ""
        current += engine.tokenizer.convert_tokens_to_string([piece])
    words.append(current)
    # every word the tokenizer produced begins at a whitespace boundary, digits stay together
    assert [w.strip() for w in words] == [
        "The",
        "magic",
        "number",
        "is:",
        "7007071.",
        "Remember",
        "it",
    ]
    assert words[4] == " 7007071."  # the lone space token opens the number's word


def test_segments_split_long_words() -> None:
    starts = torch.tensor([1, 0, 0, 0, 0, 1, 0], dtype=torch.bool)
    segments = segment_ids(starts, max_tokens=3)
    # word 0 has 5 tokens -> pieces of 3 and 2; word 1 has 2 tokens
    assert segments[0] == segments[1] == segments[2]
    assert segments[3] == segments[4] != segments[2]
    assert segments[5] == segments[6] != segments[4]


def test_carry_forward_is_a_running_max_within_each_word() -> None:
    scores = torch.tensor([[[0.1, 0.9, 0.2, 0.3, 0.5, 0.1, 0.4]]])
    starts = torch.tensor([1, 0, 0, 0, 1, 0, 1], dtype=torch.bool)
    carried = carry_forward(scores, segment_ids(starts, 12), 12)
    expected = torch.tensor([[[0.1, 0.9, 0.9, 0.9, 0.5, 0.5, 0.4]]])
    assert torch.equal(carried, expected)


def test_a_kept_word_start_keeps_the_rest_of_its_word() -> None:
    engine = tiny_engine("llama")
    prompt = random_prompt(96, seed=3)
    starts = torch.zeros(96, dtype=torch.bool)
    starts[::6] = True  # words of six tokens
    window, budget = 8, 40
    snap = make_press("snapkv", budget=budget, window=window)
    spans = make_press("wordspan", budget=budget, window=window, max_word_tokens=12)
    [plain, completed] = engine.runtime.prefill_many(prompt, [snap, spans])
    # prefill_many computes word starts from the tokenizer; redo the compression with ours
    cache = engine.runtime.new_cache()
    with compression_hooks(engine.loaded.model, spans, word_starts=starts) as recorder:
        recorder.armed = True
        engine.runtime.forward(prompt, cache, 0)
    changed = 0
    for layer, snap_layer in zip(recorder.layer_results(0), plain.kept, strict=True):
        assert layer.indices.shape == snap_layer.indices.shape  # same budget
        changed += int(not torch.equal(layer.indices, snap_layer.indices))
        for head in layer.indices[0]:
            kept = set(head.tolist())
            prefix = 96 - window
            # a kept token whose next word-mate is dropped: only possible at the top-k margin
            # (the carried scores of a word tie), so at most one such cut per head
            cuts = sum(
                1 for p in kept if p + 1 < prefix and not starts[p + 1] and p + 1 not in kept
            )
            assert cuts <= 1
    assert changed > 0  # completion really changed the selection
