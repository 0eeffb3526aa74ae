"""The lean Llama pass: the same logits and cache entries as transformers' module tree."""

from __future__ import annotations

import pytest
import torch

from ragsnap.runtime.forward import BatchedKV, forward_rows
from ragsnap.runtime.llama_pass import llama_pass_for
from ragsnap.runtime.loading.cpu_linears import can_pack_half, pack_linears
from ragsnap.runtime.loading.fused_projections import fuse_projections
from tests.test_runtime import tiny_prefills
from tests.tiny_models import ARCHITECTURES, random_prompt, tiny_engine

LEAN = ("llama", "mistral", "qwen2")


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_only_plain_llama_layers_get_the_lean_pass(arch) -> None:
    engine = tiny_engine(arch)
    assert (llama_pass_for(engine.loaded.model) is not None) == (arch in LEAN)
    assert (engine.runtime.lean is not None) == (arch in LEAN)


def _rows(engine) -> BatchedKV:
    """The four test requests (biased, unequal layer lengths, a full cache) as one batch."""
    kv = BatchedKV(engine.runtime.windows)
    for prefill, _ in tiny_prefills(engine):
        kv.add(prefill.layers, prefill.original_length, prefill.bias)
    return kv


def _same_passes(engine, feeds) -> None:
    """Feeding ``feeds`` (per pass, the tokens of each row) through both paths gives the
    same logits and leaves the same entries in every row's cache."""
    model, kwarg = engine.loaded.model, engine.loaded.cache_kwarg
    tree, lean = _rows(engine), _rows(engine)
    for tokens in feeds:
        last = len({len(t) for t in tokens}) == 1 and len(tokens[0]) == 1
        expected = forward_rows(model, kwarg, tree, tokens, last=last)
        got = forward_rows(model, kwarg, lean, tokens, last=last, lean=engine.runtime.lean)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(tree.lengths, lean.lengths)
    for r in range(tree.rows):
        for (k1, v1), (k2, v2) in zip(tree.row_layers(r), lean.row_layers(r), strict=True):
            torch.testing.assert_close(k2, k1, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(v2, v1, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("arch", LEAN)
def test_lean_pass_matches_the_module_tree(arch, fused) -> None:
    engine = tiny_engine(arch)
    if fused:  # one product for q/k/v and one for gate/up, as a CPU model loads
        assert fuse_projections(engine.loaded.model) == 2 * len(engine.loaded.model.model.layers)
    feeds = [
        [[5], [6], [7], [8]],  # one token each
        [[9, 10, 11], [12], [13, 14], [15, 16, 17]],  # drafts of unequal length
        [[18], [19], [20], [21]],
    ]
    _same_passes(engine, feeds)


def test_lean_pass_keeps_sliding_windows() -> None:
    """A Mistral with a window shorter than the prompts: the step masks bound it."""
    engine = tiny_engine("mistral", sliding_window=24)
    assert set(engine.runtime.windows) == {24}
    _same_passes(engine, [[[5], [6], [7], [8]], [[9, 10], [11], [12], [13, 14]]])


@pytest.mark.skipif(not can_pack_half(), reason="fbgemm cannot pack float32 linears here")
@pytest.mark.parametrize("fused", [False, True])
def test_lean_pass_follows_linears_swapped_after_it_was_made(fused) -> None:
    engine = tiny_engine("llama")
    if fused:
        fuse_projections(engine.loaded.model)
    assert pack_linears(engine.loaded.model) > 0
    _same_passes(engine, [[[5], [6], [7], [8]]])


def test_decoding_rows_with_and_without_the_lean_pass_gives_the_same_tokens() -> None:
    engine = tiny_engine("qwen2")
    requests = tiny_prefills(engine)

    def answers(lean) -> list[list[int]]:
        engine.runtime.lean = lean
        batch = engine.runtime.decode_batch(stop_ids=set())
        rows = [batch.add(i, p, g) for i, (p, g) in enumerate(requests)]
        for _ in batch.run():
            pass
        return [row.tokens for row in rows]

    lean = engine.runtime.lean
    assert lean is not None
    assert answers(lean) == answers(None)
    assert [len(t) for t in answers(lean)] == [g.max_new_tokens for _, g in requests]


@pytest.mark.parametrize("arch", LEAN)
def test_a_prompt_chunk_riding_a_decode_step_changes_neither(arch) -> None:
    """A decode step that computes a prefill chunk in its pass (issue 42) gives the rows the
    tokens they get alone, and the prompt the cache and logits of a plain chunked prefill."""
    from transformers import DynamicCache

    from ragsnap.compression import make_press
    from ragsnap.runtime.llama_pass import ChunkFeed
    from ragsnap.runtime.prefill import prefill

    engine = tiny_engine(arch)
    model, kwarg = engine.loaded.model, engine.loaded.cache_kwarg
    prompt = random_prompt(90, seed=3)
    press = make_press("snapkv", budget=24, window=8)

    def run(riding: bool):
        batch = engine.runtime.decode_batch(set())
        rows = [batch.add(i, p, g) for i, (p, g) in enumerate(tiny_prefills(engine))]
        rode: list[bool] = []

        class Between:  # the scheduler's on_chunk: a decode step per chunk
            def __call__(self) -> None:
                if not riding:
                    batch.step()

            def ride(self, ids, cache, begin) -> bool:
                if not riding:
                    return False
                feed = ChunkFeed(ids, cache, begin)
                batch.step(feed)
                rode.append(feed.done)
                return feed.done

        [result] = prefill(
            model,
            kwarg,
            prompt,
            press,
            cache=DynamicCache(config=model.config),
            chunk=32,
            on_chunk=Between(),
        )
        return result, [list(r.tokens) for r in rows], rode

    plain, plain_tokens, _ = run(False)
    fused, fused_tokens, rode = run(True)
    assert rode == [True, True]  # 90 tokens in chunks of 32: two ride, the last runs alone
    assert fused_tokens == plain_tokens and all(len(t) == 2 for t in plain_tokens)
    torch.testing.assert_close(fused.next_logits, plain.next_logits, atol=1e-5, rtol=1e-5)
    for (k1, v1), (k2, v2) in zip(plain.layers, fused.layers, strict=True):
        torch.testing.assert_close(k2, k1, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v2, v1, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", LEAN)
def test_a_prefill_computes_its_plain_chunks_in_the_lean_pass(arch, monkeypatch) -> None:
    """Chunks no hook watches go through the lean pass (a press's last one, whose attention
    it reads, through the module tree): the same logits, kept entries and full KV."""
    from transformers import DynamicCache

    import ragsnap.runtime.prefill as prefill_module
    from ragsnap.compression import make_press
    from ragsnap.runtime.llama_pass import LlamaPass

    engine = tiny_engine(arch)
    model, kwarg = engine.loaded.model, engine.loaded.cache_kwarg
    prompt = random_prompt(90, seed=3)
    alone: list[int] = []
    real_chunk = LlamaPass.chunk
    monkeypatch.setattr(
        LlamaPass, "chunk", lambda self, feed: (alone.append(feed.begin), real_chunk(self, feed))
    )

    def run():
        press = make_press("snapkv", budget=24, window=8)
        [result] = prefill_module.prefill(
            model, kwarg, prompt, press, cache=DynamicCache(config=model.config), chunk=32
        )
        full = DynamicCache(config=model.config)
        prefill_module.prefill_full(model, kwarg, prompt, full, chunk=32)
        return result, full

    lean, lean_full = run()
    # the press's prefill: two chunks of three (the last in the tree); the full pass: all
    assert alone == [0, 32, 0, 32, 64]
    monkeypatch.setattr(prefill_module, "chunk_pass", lambda model: None)
    tree, tree_full = run()
    assert len(alone) == 5
    torch.testing.assert_close(lean.next_logits, tree.next_logits, atol=1e-5, rtol=1e-5)
    for (k1, v1), (k2, v2) in zip(tree.layers, lean.layers, strict=True):
        torch.testing.assert_close(k2, k1, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v2, v1, atol=1e-5, rtol=1e-5)
    for a, b in zip(tree_full.layers, lean_full.layers, strict=True):
        torch.testing.assert_close(b.keys, a.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(b.values, a.values, atol=1e-5, rtol=1e-5)
