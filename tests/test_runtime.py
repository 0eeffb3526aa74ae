"""The model runtime: batched rows decode exactly as alone, chunked prefill, teacher forcing."""

from __future__ import annotations

import pytest
import torch

from ragsnap.compression import make_press
from ragsnap.prompt.documents import Document
from ragsnap.runtime.forward import BatchedKV, forward_rows
from ragsnap.runtime.generation import GenerationConfig
from ragsnap.runtime.kv import derive_cache
from ragsnap.runtime.prefill import chunk_starts, forward_chunk
from tests.tiny_models import ARCHITECTURES, random_prompt, tiny_engine

# four requests that differ in prompt length, press, budget and answer length
REQUESTS = [
    (90, ("ragsnap", 24), 12),
    (64, ("snapkv", 40), 7),
    (120, ("full", None), 15),
    (75, ("pyramidkv", 30), 9),
]


def tiny_prefills(engine):
    out = []
    for length, (press, budget), new in REQUESTS:
        options = {} if budget is None else {"budget": budget, "window": 8}
        prefill = engine.runtime.prefill(
            random_prompt(length, seed=length), make_press(press, **options)
        )
        out.append((prefill, GenerationConfig(max_new_tokens=new)))
    return out


def decode(runtime, requests, stop_ids=None):
    """Every request as a row of one batch: the tokens of each."""
    batch = runtime.decode_batch(stop_ids)
    rows = [batch.add(i, p, g) for i, (p, g) in enumerate(requests)]
    for _ in batch.run():
        pass
    return [r.tokens for r in rows]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_batched_greedy_rows_decode_exactly_as_alone(arch) -> None:
    engine = tiny_engine(arch)
    requests = tiny_prefills(engine)
    alone = [decode(engine.runtime, [r], stop_ids=set())[0] for r in requests]
    together = decode(engine.runtime, requests, stop_ids=set())
    assert together == alone
    assert [len(t) for t in together] == [new for _, _, new in REQUESTS]
    # the batch really mixes a per-key bias (default press) and unequal layer lengths
    assert requests[0][0].bias
    assert len(set(requests[3][0].kept_tokens_per_layer)) > 1


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen2"])
def test_runtime_decoding_equals_plain_transformers_decoding(arch) -> None:
    """Without a bias, the masked batched path reproduces the model's own attention
    (sliding windows included: the Gemma3 prompt is longer than its window)."""
    engine = tiny_engine(arch)
    prompt = random_prompt(100, seed=3)
    for press in (make_press("full"), make_press("streamingllm", budget=30, window=8)):
        prefill = engine.runtime.prefill(prompt, press)
        cache, logits, reference = derive_cache(prefill.cache), prefill.next_logits, []
        for position in range(len(prompt), len(prompt) + 20):
            reference.append(int(logits.argmax()))
            logits = forward_chunk(
                engine.loaded.model, engine.loaded.cache_kwarg, reference[-1:], cache, position
            )
        generation = GenerationConfig(max_new_tokens=20)
        assert decode(engine.runtime, [(prefill, generation)], stop_ids=set())[0] == reference


def test_seeded_sampling_gives_a_row_the_same_tokens_whatever_its_batch() -> None:
    engine = tiny_engine("llama")
    requests = tiny_prefills(engine)
    sampled = GenerationConfig(max_new_tokens=10, temperature=0.9, top_p=0.95, seed=11)
    alone = decode(engine.runtime, [(requests[0][0], sampled)], stop_ids=set())[0]
    mixed = decode(engine.runtime, [requests[1], (requests[0][0], sampled), requests[2]], set())
    assert mixed[1] == alone
    other_seed = GenerationConfig(max_new_tokens=10, temperature=0.9, top_p=0.95, seed=12)
    assert decode(engine.runtime, [(requests[0][0], other_seed)], stop_ids=set())[0] != alone


def test_a_cancelled_row_leaves_the_others_unchanged_and_a_late_row_joins() -> None:
    engine = tiny_engine("llama")
    requests = tiny_prefills(engine)
    alone = [decode(engine.runtime, [r], stop_ids=set())[0] for r in requests]
    batch = engine.runtime.decode_batch(stop_ids=set())
    rows = {i: batch.add(i, *requests[i]) for i in (0, 1, 2)}
    reasons = {}
    for step in range(40):
        if step == 3:
            batch.cancel(1)
        if step == 4:  # arrives mid-generation
            rows[3] = batch.add(3, *requests[3])
        for out in batch.step():
            if out.finish_reason:
                reasons[out.key] = out.finish_reason
        if not len(batch):
            break
    assert reasons == {0: "length", 1: "cancelled", 2: "length", 3: "length"}
    assert rows[1].tokens == alone[1][:3]
    assert [rows[i].tokens for i in (0, 2, 3)] == [alone[i] for i in (0, 2, 3)]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_multi_token_teacher_forcing_equals_one_token_per_step(arch) -> None:
    engine = tiny_engine(arch)
    prefills = [p for p, _ in tiny_prefills(engine)]
    tokens = random_prompt(8, seed=99)
    batched = engine.runtime.teacher_force(prefills, tokens)  # [4, 8, V]
    for row, prefill in enumerate(prefills):
        kv = BatchedKV(engine.runtime.windows)
        kv.add(prefill.layers, prefill.original_length, prefill.bias)
        steps = [
            forward_rows(engine.loaded.model, engine.loaded.cache_kwarg, kv, [[t]], last=True)
            for t in tokens
        ]
        single = torch.log_softmax(torch.cat(steps).float(), dim=-1)
        assert torch.allclose(batched[row], single, atol=1e-4)


def test_chunk_boundaries_leave_the_observation_window_to_the_last_chunk() -> None:
    assert chunk_starts(0, 100, 32, 8) == [0, 32, 64, 92]  # the last chunk moves back to cover 8
    starts = chunk_starts(0, 100, 32, 40)
    assert starts[0] == 0 and 100 - starts[-1] >= 40 and starts == sorted(starts)
    assert chunk_starts(10, 30, 64, 8) == [10]
    assert chunk_starts(0, 96, 32, 8) == [0, 32, 64]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_chunked_prefill_keeps_exactly_the_entries_of_a_one_shot_prefill(arch) -> None:
    one_shot, chunked = tiny_engine(arch), tiny_engine(arch)
    chunked.runtime.chunk = 16
    calls = []
    for length, (press, budget), _ in REQUESTS:
        options = {} if budget is None else {"budget": budget, "window": 8}
        prompt = random_prompt(length, seed=length)
        a = one_shot.runtime.prefill(prompt, make_press(press, **options))
        b = chunked.runtime.prefill(
            prompt, make_press(press, **options), on_chunk=lambda: calls.append(1)
        )
        for x, y in zip(a.kept, b.kept, strict=True):
            assert torch.equal(x.indices, y.indices)
        assert torch.allclose(a.next_logits, b.next_logits, atol=1e-4)
        generation = GenerationConfig(max_new_tokens=8)
        assert decode(one_shot.runtime, [(a, generation)], set()) == decode(
            chunked.runtime, [(b, generation)], set()
        )
    assert len(calls) >= sum(length // 16 - 1 for length, _, _ in REQUESTS)


def test_an_exception_between_chunks_abandons_the_prefill() -> None:
    engine = tiny_engine("llama")
    engine.runtime.chunk = 16
    seen = []

    def cancel() -> None:
        seen.append(1)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        engine.runtime.prefill(
            random_prompt(100), make_press("snapkv", budget=24, window=8), on_chunk=cancel
        )
    assert seen == [1]  # stopped after the first chunk


@pytest.mark.model
def test_embedded_model_rows_decode_exactly_as_alone(engine) -> None:
    text = (
        "The Rosetta Stone is kept in the British Museum in London, where it has been on "
        "display since 1802. It was found in 1799 near the town of Rashid. "
    )
    questions = [
        "Where is the Rosetta Stone kept?",
        "When was it found?",
        "Since when is it on display?",
        "Where was it found?",
    ]
    presses = [
        make_press("ragsnap", budget=64),
        make_press("snapkv", budget=96),
        make_press("pyramidkv", budget=80),
        make_press("full"),
    ]
    requests = []
    for i, (question, press) in enumerate(zip(questions, presses, strict=True)):
        docs = [Document(id=f"d{j}", title=f"Part {j}", text=text * (2 + i)) for j in range(2)]
        layout = engine.build_prompt(question, docs, GenerationConfig())
        prefill = engine.runtime.prefill(layout.input_ids, press)
        requests.append((prefill, GenerationConfig(max_new_tokens=10 + 4 * i)))
    alone = [decode(engine.runtime, [r])[0] for r in requests]
    assert decode(engine.runtime, requests) == alone
    assert all(alone)
    assert len({p.original_length for p, _ in requests}) == 4


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_chunked_prefill_through_the_runtime_attention_equals_transformers_sdpa(arch) -> None:
    """A chunk on top of a cache is masked: the runtime reads grouped KV heads in place
    on a CPU where transformers copies them; the logits and cache are the same."""
    engine = tiny_engine(arch)
    model, kwarg, prompt = engine.loaded.model, engine.loaded.cache_kwarg, random_prompt(80, seed=5)
    assert model.config._attn_implementation == "ragsnap_sdpa"

    def chunked(implementation):
        model.set_attn_implementation(implementation)
        cache = engine.runtime.new_cache()
        logits = [forward_chunk(model, kwarg, prompt[i : i + 24], cache, i) for i in (0, 24, 48)]
        return torch.cat(logits), cache

    try:
        reference, reference_cache = chunked("sdpa")
        ours, cache = chunked("ragsnap_sdpa")
    finally:
        model.set_attn_implementation("ragsnap_sdpa")
    assert torch.allclose(ours, reference, atol=1e-5)
    for a, b in zip(cache.layers, reference_cache.layers, strict=True):
        assert torch.allclose(a.keys, b.keys, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_32_rows_of_very_different_lengths_decode_as_alone_in_lanes_of_like_widths(
    arch, monkeypatch
) -> None:
    """Full caches of 600-900 entries beside compressed ones of 24-40: every row decodes
    exactly as alone (float32), and rows sit in lanes whose buffers are padded only to
    their own lane's widest row, not to the batch's. A Llama decodes every lane in one
    lean pass; Gemma 3 (no lean pass) one call per lane."""
    from ragsnap.runtime import decode as decode_module

    engine = tiny_engine(arch)
    together = []
    real = decode_module.forward_lanes
    monkeypatch.setattr(
        decode_module,
        "forward_lanes",
        lambda *a, **k: together.append(len(a[1])) or real(*a, **k),
    )
    requests = []
    for i in range(32):
        if i % 8 == 3:  # 4 full caches of long prompts
            prefill = engine.runtime.prefill(
                random_prompt(600 + 100 * (i // 8), seed=i), make_press("full")
            )
        else:
            budget = 24 + (i % 3) * 8
            press = make_press("snapkv", budget=budget, window=8)
            prefill = engine.runtime.prefill(random_prompt(60 + 7 * i, seed=i), press)
        requests.append((prefill, GenerationConfig(max_new_tokens=4 + i % 5)))
    alone = [decode(engine.runtime, [r], stop_ids=set())[0] for r in requests]
    batch = engine.runtime.decode_batch(stop_ids=set())
    rows = [batch.add(i, p, g) for i, (p, g) in enumerate(requests)]
    assert len(batch.lanes) == 2
    assert sorted(len(lane.rows) for lane in batch.lanes) == [4, 28]
    # one buffer for all would pad 32 rows to 900 entries; the lanes hold far less
    keys = requests[0][0].layers[0][0]  # [1, Hkv, n, D]
    entry_bytes = (
        2 * keys.shape[1] * keys.shape[3] * keys.element_size() * len(engine.runtime.windows)
    )
    widest = max(int(p.original_length) for p, _ in requests)
    assert batch.buffer_bytes() < 0.25 * 32 * widest * entry_bytes
    for _ in batch.run():
        pass
    assert [r.tokens for r in rows] == alone
    assert not batch.lanes
    # lanes decoded together while two were left (the 4 full rows end within 4-8 steps)
    assert (set(together) == {2}) if arch == "llama" else not together
