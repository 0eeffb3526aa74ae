"""Batched tails: prefix hits finished together keep what each would keep alone."""

from __future__ import annotations

import pytest
import torch

from ragsnap.compression import make_press
from ragsnap.runtime.forward import BatchedKV, forward_rows
from ragsnap.runtime.generation import GenerationConfig
from ragsnap.runtime.tails import Tail
from tests.tiny_models import random_prompt, tiny_engine

# (prompt length, prefix length, press): tails of 5 to 20 tokens, windows of 8 and 6
CASES = [
    (120, 110, ("ragsnap-lookahead", {"budget": 24, "window": 8})),
    (90, 70, ("snapkv", {"budget": 30, "window": 6})),
    (150, 145, ("ragsnap-lookahead", {"budget": 40, "window": 8, "lookahead": 3})),
    (60, 52, ("full", {"window": 8})),  # keeps every entry, as they are
]


def serial_and_batched(engine, seed=0):
    runtime = engine.runtime
    tails, serial = [], []
    for length, prefix_len, (name, options) in CASES:
        ids = random_prompt(length, seed=length + seed)
        press = make_press(name, **options)
        prefix = runtime.prefill_full(ids[:prefix_len])
        start = min(prefix_len, length - options["window"])
        cropped = [(k[:, :, :start], v[:, :, :start]) for k, v in prefix]
        serial.append(runtime.prefill(ids, press, cache=runtime.cache_from(cropped), start=start))
        tails.append(Tail(ids, prefix, start, press))
    return serial, runtime.prefill_tails(tails)


def decode(runtime, prefill, tokens=10):
    batch = runtime.decode_batch(stop_ids=set())
    row = batch.add(0, prefill, GenerationConfig(max_new_tokens=tokens))
    for _ in batch.run():
        pass
    return row.tokens


def test_tails_finished_together_equal_each_prefilled_alone() -> None:
    engine = tiny_engine("llama")
    engine.runtime.stop_ids = {1}
    serial, batched = serial_and_batched(engine)
    for alone, together in zip(serial, batched, strict=True):
        assert together.original_length == alone.original_length
        assert together.draft == alone.draft
        assert torch.allclose(together.next_logits, alone.next_logits, atol=1e-4)
        for a, b in zip(alone.kept, together.kept, strict=True):
            assert torch.equal(a.indices, b.indices)
            assert torch.allclose(a.values, b.values, rtol=1e-3, atol=1e-3)
        assert alone.bias.keys() == together.bias.keys()
        for layer, bias in alone.bias.items():
            assert torch.allclose(together.bias[layer], bias, atol=1e-3)
        assert decode(engine.runtime, together) == decode(engine.runtime, alone)
    # the lookahead presses drafted (3 and 8 tokens unless a stop came first); snapkv did not
    assert serial[0].draft and serial[2].draft and not serial[1].draft
    assert len(serial[2].draft) <= 3
    # the batch fed every row the longest tail (20 tokens): shorter tails started earlier
    assert [r.processed_tokens for r in batched] == [20, 20, 20, 20]
    # the next batch reuses the batch memory: no result of this one refers to it
    before = [[(k.clone(), v.clone()) for k, v in r.layers] for r in batched]
    serial_and_batched(engine, seed=1)
    for result, layers in zip(batched, before, strict=True):
        for (k, v), (k0, v0) in zip(result.layers, layers, strict=True):
            assert torch.equal(k, k0) and torch.equal(v, v0)
    assert engine.runtime._tail_scratch  # kept for the next batch


def test_rows_compressed_side_by_side_keep_what_rows_compressed_in_turn_keep(
    monkeypatch,
) -> None:
    import threading

    from ragsnap.compression.hooks import CompressionRecorder
    from ragsnap.runtime.threads import torch_threads

    engine = tiny_engine("llama")
    engine.runtime.stop_ids = {1}
    where = []
    real = CompressionRecorder.compress_pending

    def compress_pending(self, *args):
        where.append((threading.current_thread().name, torch.get_num_threads()))
        return real(self, *args)

    monkeypatch.setattr(CompressionRecorder, "compress_pending", compress_pending)
    with torch_threads(1):  # one thread: the rows are compressed in turn, here
        _, in_turn = serial_and_batched(engine)
    batched_rows = where[-len(CASES) :]
    assert {name for name, _ in batched_rows} == {threading.current_thread().name}
    with torch_threads(2):  # one row per worker thread, each computing on one thread
        _, side_by_side = serial_and_batched(engine)
    batched_rows = where[-len(CASES) :]
    assert all(name.startswith("ragsnap-compress") for name, _ in batched_rows)
    assert {threads for _, threads in batched_rows} == {1}
    for a, b in zip(in_turn, side_by_side, strict=True):
        assert a.draft == b.draft
        for x, y in zip(a.kept, b.kept, strict=True):
            assert torch.equal(x.indices, y.indices)
            assert torch.allclose(x.values, y.values, rtol=1e-4, atol=1e-4)


def test_sliding_window_models_and_every_query_presses_are_not_batched() -> None:
    gemma = tiny_engine("gemma3")
    ids = random_prompt(60, seed=1)
    prefix = gemma.runtime.prefill_full(ids[:50])
    snap = make_press("snapkv", budget=20, window=8)
    assert not gemma.runtime.tails_batchable([Tail(ids, prefix, 50, snap)])
    llama = tiny_engine("llama")
    prefix = llama.runtime.prefill_full(ids[:50])
    assert llama.runtime.tails_batchable([Tail(ids, prefix, 50, snap)])
    h2o = make_press("h2o", budget=20, window=8)
    assert not llama.runtime.tails_batchable([Tail(ids, prefix, 50, h2o)])
    with pytest.raises(ValueError, match="one batch"):
        llama.runtime.prefill_tails([Tail(ids, prefix, 50, h2o)])


def test_a_batch_built_from_rows_holds_each_row_and_its_spare_room() -> None:
    rows = [
        [(torch.full((1, 2, n, 4), float(n)), torch.full((1, 2, n, 4), -float(n)))] * 2
        for n in (3, 5)
    ]
    batch = BatchedKV.of_rows([None, None], rows, [7, 9], reserve=4)
    assert batch.rows == 2 and batch.lengths.tolist() == [[3, 3], [5, 5]]
    assert batch.positions.tolist() == [7, 9] and batch.keys[0].shape == (2, 2, 9, 4)
    for r in range(2):
        for k, v in batch.row_layers(r):
            assert torch.equal(k, rows[r][0][0]) and torch.equal(v, rows[r][0][1])
    with pytest.raises(ValueError, match="2 layers"):
        BatchedKV.of_rows([None, None], [rows[0][:1]], [3])


def test_reserved_batch_memory_is_what_the_next_batches_use() -> None:
    engine = tiny_engine("llama")
    engine.runtime.stop_ids = {1}
    want = serial_and_batched(engine)[1]  # memory allocated on first use
    fresh = tiny_engine("llama")
    fresh.runtime.stop_ids = {1}
    config = fresh.runtime.model.config
    head_dim = config.hidden_size // config.num_attention_heads
    reserved = fresh.runtime.reserve_tails(len(CASES), 200)
    scratch = list(fresh.runtime._tail_scratch)
    assert len(scratch) == config.num_hidden_layers
    assert all(k.shape == (4, config.num_key_value_heads, 200, head_dim) for k, _ in scratch)
    assert reserved == sum(k.nbytes + v.nbytes for k, v in scratch)
    got = serial_and_batched(fresh)[1]
    # the batch lived in the reserved memory (nothing was reallocated), with the same results
    assert all(
        a[0] is b[0] and a[1] is b[1]
        for a, b in zip(fresh.runtime._tail_scratch, scratch, strict=True)
    )
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a.next_logits, b.next_logits) and a.draft == b.draft
        for (k, v), (k2, v2) in zip(a.layers, b.layers, strict=True):
            assert torch.equal(k, k2) and torch.equal(v, v2)
    assert fresh.runtime.reserve_tails(0, 200) == 0
    assert fresh.runtime.reserve_tails(2, 100) == reserved  # smaller: the memory stays
    assert all(a[0] is b[0] for a, b in zip(fresh.runtime._tail_scratch, scratch, strict=True))


@pytest.mark.model
def test_drafts_guessed_from_the_prompts_are_the_one_token_drafts_in_fewer_passes(engine):
    """Two rows drafting answers that copy their documents (embedded model, float32): with
    guesses from each row's prompt the drafts, their voting queries and the rows' caches are
    those of one-token passes, in fewer passes."""
    from ragsnap.prompt.documents import Document
    from ragsnap.runtime.prefill import drain
    from ragsnap.runtime.tails import draft_rows

    model, kwarg = engine.loaded.model, engine.loaded.cache_kwarg
    prompts = [
        engine.build_prompt(
            question,
            [Document(id="1", text=text)],
            GenerationConfig(max_new_tokens=8),
            order="given",
        ).input_ids
        for question, text in (
            (
                "Who is the station's chief engineer?",
                "The station's chief engineer is Margarethe Vollenweider-Okonkwo.",
            ),
            (
                "What does the enzyme lactase break down?",
                "Lactase breaks down lactose into glucose.",
            ),
        )
    ]
    runs = []
    for contexts, lean in (((), None), (prompts, None), (prompts, engine.runtime.lean)):
        prefixes = [engine.runtime.prefill_full(ids[:-1]) for ids in prompts]
        starts = [len(ids) - 1 for ids in prompts]
        batch = BatchedKV.of_rows(engine.runtime.windows, prefixes, starts, reserve=16)
        logits = forward_rows(model, kwarg, batch, [[ids[-1]] for ids in prompts], last=True)
        calls: list[int] = []
        real = model.forward

        def counted(*args, calls=calls, real=real, **kwargs):
            calls.append(kwargs["input_ids"].shape[1])
            return real(*args, **kwargs)

        model.forward = counted
        try:
            queries, drafts = drain(
                draft_rows(model, kwarg, batch, logits, [8, 8], set(), contexts, lean)
            )
        finally:
            del model.forward
        runs.append((queries, drafts, batch, len(calls)))
    (q1, d1, b1, passes1), (q2, d2, b2, passes2), (q3, d3, b3, passes3) = runs
    assert d3 == d2 == d1 and all(len(d) == 8 for d in d1)
    assert passes2 < passes1 == 8
    assert passes3 == 0  # the lean pass ran them, recording the queries itself
    for layer in q1:
        torch.testing.assert_close(q2[layer], q1[layer], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(q3[layer], q1[layer], atol=1e-4, rtol=1e-4)
    # each row's prompt and draft; a row done early fed the others' passes past its draft
    for r, ids in enumerate(prompts):
        end = len(ids) + len(d1[r])
        for b in (b2, b3):
            for (k1, v1), (k2, v2) in zip(b1.row_layers(r), b.row_layers(r), strict=True):
                torch.testing.assert_close(k2[:, :, :end], k1[:, :, :end], atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(v2[:, :, :end], v1[:, :, :end], atol=1e-4, rtol=1e-4)


def test_a_row_whose_guesses_are_confirmed_never_outgrows_the_batch(monkeypatch) -> None:
    """Every row feeds each draft pass, its own draft done or not: the longest prompt,
    its guesses confirmed so that it drafts all its tokens in the first pass, keeps
    growing while another row drafts one token a pass. The batch's room covers it
    (regrowing copies every row's whole prompt)."""
    import ragsnap.runtime.tails as tails_module
    from ragsnap.runtime.drafts import Drafts

    engine = tiny_engine("llama")
    runtime = engine.runtime
    runtime.stop_ids = set()
    tails = []
    for length in (200, 120):
        ids = random_prompt(length, seed=length)
        prefix = runtime.prefill_full(ids[: length - 10])
        press = make_press("ragsnap-lookahead", budget=24, window=8, lookahead=8)
        tails.append(Tail(ids, prefix, length - 10, press))
    drafts = [r.draft for r in runtime.prefill_tails(tails)]  # greedy's, guessed or not
    known = {200: drafts[0]}

    class Confirmed(Drafts):
        def draft(self, k: int) -> list[int]:  # the long row guesses what greedy picks
            done = len(self.tokens) - self.answer_start
            return known.get(self.answer_start, [])[done : done + k]

    grown: list[tuple[int, int]] = []
    grow = BatchedKV._grow

    def recording(self, layer: int, needed: int) -> None:
        if needed > self.keys[layer].shape[2]:
            grown.append((self.keys[layer].shape[2], needed))
        grow(self, layer, needed)

    monkeypatch.setattr(tails_module, "Drafts", Confirmed)
    monkeypatch.setattr(BatchedKV, "_grow", recording)
    assert [r.draft for r in runtime.prefill_tails(tails)] == drafts
    assert grown == []


def test_draft_passes_computed_in_decode_steps_give_what_each_gives_alone() -> None:
    """A prefix-hit group's draft passes ride the running rows' decode steps (one lean pass
    for both, :class:`DraftPass`): the group's drafts and compressed caches, and the rows'
    tokens, are those each gives alone."""
    from ragsnap.runtime.forward import DraftPass

    engine = tiny_engine("llama")
    runtime = engine.runtime
    runtime.stop_ids = set()

    def group():
        tails = []
        for length, prefix_len, (name, options) in CASES[:3]:
            ids = random_prompt(length, seed=length)
            start = min(prefix_len, length - options["window"])
            tails.append(
                Tail(
                    ids, runtime.prefill_full(ids[:prefix_len]), start, make_press(name, **options)
                )
            )
        return tails

    press = make_press("snapkv", budget=24, window=8)
    requests = [
        (
            runtime.prefill(random_prompt(50 + 9 * i, seed=40 + i), press),
            GenerationConfig(max_new_tokens=12),
        )
        for i in range(3)
    ]
    alone_rows = []
    for prefill, generation in requests:
        batch = runtime.decode_batch(stop_ids=set())
        row = batch.add(0, prefill, generation)
        for _ in batch.run():
            pass
        alone_rows.append(row.tokens)
    alone = runtime.prefill_tails(group())

    batch = runtime.decode_batch(stop_ids=set())
    rows = [batch.add(i, p, g) for i, (p, g) in enumerate(requests)]
    steps = runtime.prefill_tails_steps(group())
    passes = rode = 0
    while True:
        try:
            step = next(steps)
        except StopIteration as finished:
            together = finished.value
            break
        if isinstance(step, DraftPass):
            passes += 1
            batch.step(draft=step)
            rode += step.logits is not None
    for _ in batch.run():
        pass
    assert passes >= 3 and rode == passes  # the longest draft (8 tokens) took several passes
    assert [row.tokens for row in rows] == alone_rows
    for a, b in zip(alone, together, strict=True):
        assert b.draft == a.draft
        assert torch.allclose(b.next_logits, a.next_logits, atol=1e-4)
        for x, y in zip(a.kept, b.kept, strict=True):
            assert torch.equal(x.indices, y.indices)
            assert torch.allclose(x.values, y.values, rtol=1e-3, atol=1e-3)
        for layer, bias in a.bias.items():
            assert torch.allclose(b.bias[layer], bias, atol=1e-3)


def test_batch_memory_too_small_is_replaced_with_room_the_next_batches_reuse() -> None:
    """Scratch memory that cannot hold a batch is replaced by memory of its rows (or the
    batch's, if more) and the batch's width rounded up to 512 entries: a deployment's
    next batches of about that size reuse it instead of touching fresh pages again."""

    def row(n: int):
        return [(torch.full((1, 2, n, 4), float(n)), torch.full((1, 2, n, 4), -float(n)))]

    scratch: list = []
    BatchedKV.of_rows([None], [row(100), row(90)], [100, 90], reserve=10, scratch=scratch)
    held = scratch[0][0]
    assert held.shape == (2, 2, 512, 4)
    batch = BatchedKV.of_rows([None], [row(300)], [300], reserve=20, scratch=scratch)
    assert scratch[0][0] is held and batch.keys[0].shape == (1, 2, 320, 4)
    assert torch.equal(batch.row_layers(0)[0][0], row(300)[0][0])
    BatchedKV.of_rows([None], [row(100)] * 3, [100] * 3, scratch=scratch)  # more rows
    assert scratch[0][0].shape == (3, 2, 512, 4)
    BatchedKV.of_rows([None], [row(600)], [600], scratch=scratch)  # wider
    assert scratch[0][0].shape == (3, 2, 1024, 4)
