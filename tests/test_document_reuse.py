"""The per-document tier: exact RoPE re-encoding, assembly with selective recompute, and
entries shared across questions and orders but never across namespaces or damage."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from ragsnap.cache import open_store
from ragsnap.cache.backends.store import EntryKey
from ragsnap.cache.serialization import KIND_DOCUMENT
from ragsnap.compression import SnapKVPress
from ragsnap.engine.engine import AnswerOptions, RagSnapEngine
from ragsnap.prompt.documents import Document
from ragsnap.runtime import blend
from ragsnap.runtime.attention import install_runtime_attention
from ragsnap.runtime.blend import (
    PlacedPiece,
    _assemble,
    _fresh_select_layer,
    blend_prefix,
    document_pieces,
    head_kv,
    model_cache,
    recompute_blocks,
)
from ragsnap.runtime.blend_select import question_attention
from ragsnap.runtime.generation import GenerationConfig
from ragsnap.runtime.loading.models import LoadedModel
from ragsnap.runtime.prefill import forward_chunk
from ragsnap.runtime.reencode import reencode_support, shift_layers
from tests.tiny_models import ARCHITECTURES, random_prompt, tiny_model, tiny_tokenizer

KWARG = "cache"  # transformers 5.24 renamed past_key_values


def _kv(model, ids: list[int], start: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    cache = model_cache(model)
    forward_chunk(model, KWARG, ids, cache, start)
    return [(layer.keys, layer.values) for layer in cache.layers]


def _max_diff(a, b) -> float:
    return max(
        float((x - y).abs().max())
        for (xk, xv), (yk, yv) in zip(a, b, strict=True)
        for x, y in ((xk, yk), (xv, yv))
    )


def _assert_reencoding_exact(model, ids: list[int], offset: int) -> None:
    alone, later = _kv(model, ids, 0), _kv(model, ids, offset)
    assert _max_diff(alone, later) > 1e-2  # positions do change the keys
    assert _max_diff(shift_layers(model, alone, offset), later) < 1e-4


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_reencoding_is_exact_on_tiny_models(arch):
    model = tiny_model(arch)
    assert reencode_support(model) is None
    # 12 tokens stay inside Gemma3's 16-token sliding window, so every layer keeps them all
    _assert_reencoding_exact(model, random_prompt(12, seed=1), offset=37)


def test_unsupported_rope_is_named():
    model = tiny_model(
        "llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    )
    assert "dynamic" in (reencode_support(model) or "")


def _placed(model, head: list[int], bodies: list[list[int]], order: list[int]):
    pieces = document_pieces(model, KWARG, head, bodies)
    prefix, placed = list(head), []
    for n, i in enumerate(order):
        prefix.append(2 + n)  # a label token, never cached
        placed.append(PlacedPiece(pieces[i], len(head), len(prefix)))
        prefix += bodies[i]
    return prefix, placed


def _three_pieces():
    """A tiny llama, a 5-token head and three 20-token bodies placed in the order 2, 0, 1
    (labels at positions 5, 26 and 47)."""
    model = tiny_model("llama")
    install_runtime_attention(model)
    head = random_prompt(5, seed=2)
    bodies = [random_prompt(20, seed=3 + i) for i in range(3)]
    prefix, placed = _placed(model, head, bodies, [2, 0, 1])
    return model, head, prefix, placed


def test_full_recompute_is_the_cold_prefix_and_shares_grow():
    model, head, prefix, placed = _three_pieces()
    cold = _kv(model, prefix, 0)
    full = blend_prefix(model, KWARG, prefix, len(head), placed, 1.0)
    assert _max_diff(full.layers, cold) < 1e-4
    assert len(full.recomputed) == len(prefix) - len(head)
    plain = blend_prefix(model, KWARG, prefix, len(head), placed, 0.0)
    assert plain.recomputed == [5, 26, 47]  # the labels only
    some = blend_prefix(model, KWARG, prefix, len(head), placed, 0.25)
    assert some.selected == 15 and len(some.recomputed) == 18
    # the selection pass stops after layer 1 has written its cache: that KV is the cold one
    fresh = _fresh_select_layer(model, KWARG, prefix, _kv(model, head, 0), len(head))
    assert (
        _max_diff([fresh], [(k[:, :, len(head) :], v[:, :, len(head) :]) for k, v in cold[1:2]])
        < 1e-4
    )
    errors = [_max_diff(r.layers, cold) for r in (plain, some, full)]
    assert errors[0] > errors[2]


def test_recompute_blocks_cut_in_position_order():
    at = list(range(0, 1400, 2))  # 700 positions
    assert recompute_blocks(at[:200]) == [at[:200]]  # too short to split
    blocks = recompute_blocks(at, blocks=4)
    assert [len(b) for b in blocks] == [175, 175, 175, 175] and sum(blocks, []) == at
    assert [len(b) for b in recompute_blocks(at[:300], blocks=4)] == [150, 150]


def test_recompute_in_blocks_equals_one_pass(monkeypatch):
    model, head, prefix, placed = _three_pieces()
    tail = random_prompt(6, seed=9)
    one = blend_prefix(model, KWARG, prefix, len(head), placed, 0.5, "question", tail)
    monkeypatch.setattr(blend, "BLOCK_MIN", 4)  # 33 tokens: four passes
    assert len(recompute_blocks(one.recomputed)) == 4
    blocked = blend_prefix(model, KWARG, prefix, len(head), placed, 0.5, "question", tail)
    assert blocked.recomputed == one.recomputed
    assert _max_diff(blocked.layers, one.layers) < 1e-4
    full = blend_prefix(model, KWARG, prefix, len(head), placed, 1.0)
    assert _max_diff(full.layers, _kv(model, prefix, 0)) < 1e-4


def test_question_selection_ranks_by_the_tails_attention_and_leaves_the_kv_alone(monkeypatch):
    monkeypatch.setattr(blend, "LEAD_TOKENS", 2)  # 6 leading tokens, 9 by the question
    model, head, prefix, placed = _three_pieces()
    tail = random_prompt(6, seed=9)
    cold = _kv(model, prefix, 0)
    # the probe sees the assembled prefix but appends nothing to it
    layers = [(k.clone(), v.clone()) for k, v in cold]
    hidden = torch.zeros(len(prefix), dtype=torch.bool)
    hidden[[5, 26, 47]] = True
    score = question_attention(model, KWARG, layers, tail, hidden)
    assert score.shape == (len(prefix),) and _max_diff(layers, cold) == 0
    assert (score[hidden] == 0).all() and (score[~hidden] > 0).all()
    # every query head of every layer spreads one unit per tail token over prefix and tail
    heads = model.config.num_attention_heads * model.config.num_hidden_layers
    assert 0 < float(score.sum()) < heads * len(tail) + 1e-3
    asked = blend_prefix(model, KWARG, prefix, len(head), placed, 0.25, "question", tail)
    assert asked.selected == 15 and len(asked.recomputed) == 18
    blended = _assemble(model, _kv(model, head, 0), placed, len(prefix))
    expected = question_attention(model, KWARG, blended, tail, hidden)
    body = torch.tensor([p for p in range(len(head), len(prefix)) if not hidden[p]])
    lead = {6, 7, 27, 28, 48, 49}
    rest = torch.tensor([p for p in body.tolist() if p not in lead])
    top = set(rest[expected[rest].topk(9).indices].tolist())
    assert set(asked.recomputed) == top | lead | {5, 26, 47}
    both = blend_prefix(model, KWARG, prefix, len(head), placed, 0.25, "both", tail)
    assert both.selected == 15 and len(both.recomputed) == 18
    # the whole share is the cold prefix whatever the selection; no tail: by deviation
    full = blend_prefix(model, KWARG, prefix, len(head), placed, 1.0, "question", tail)
    assert _max_diff(full.layers, cold) < 1e-4
    by_dev = blend_prefix(model, KWARG, prefix, len(head), placed, 0.25, "deviation")
    assert blend_prefix(model, KWARG, prefix, len(head), placed, 0.25, "question").recomputed == (
        by_dev.recomputed
    )
    with pytest.raises(ValueError, match="selection"):
        blend_prefix(model, KWARG, prefix, len(head), placed, 0.25, "random", tail)


def test_early_question_selection_reads_the_first_layers_and_stops_there(monkeypatch):
    from ragsnap.runtime import blend_select

    model, head, prefix, placed = _three_pieces()
    tail = random_prompt(6, seed=9)
    layers = _assemble(model, _kv(model, head, 0), placed, len(prefix))
    hidden = torch.zeros(len(prefix), dtype=torch.bool)
    hidden[[5, 26, 47]] = True
    every = blend_select.question_attention(model, KWARG, layers, tail, hidden)
    monkeypatch.setattr(blend_select, "EARLY_PROBE_LAYERS", model.config.num_hidden_layers)
    assert torch.allclose(
        blend_select.early_question_attention(model, KWARG, layers, tail, hidden), every
    )
    monkeypatch.setattr(blend_select, "EARLY_PROBE_LAYERS", 1)
    deepest = model.model.layers[-1]
    calls: list[int] = []
    hook = deepest.register_forward_hook(lambda *_: calls.append(1))
    try:
        first = blend_select.early_question_attention(model, KWARG, layers, tail, hidden)
    finally:
        hook.remove()
    assert not calls  # the probe stopped after the first layer
    assert (first[hidden] == 0).all() and (first[~hidden] > 0).all()
    # one layer's query heads spread at most one unit per tail token over the prefix
    assert float(first.sum()) <= model.config.num_attention_heads * len(tail) + 1e-3
    assert not torch.allclose(first, every)
    monkeypatch.setattr(blend, "LEAD_TOKENS", 2)  # 6 leading tokens, 9 by the first layer
    got = blend_prefix(model, KWARG, prefix, len(head), placed, 0.25, "early-question", tail)
    lead = set(blend.leading_positions(placed, len(head)).tolist())
    rest = torch.tensor(
        [p for p in range(len(head), len(prefix)) if not hidden[p] and p not in lead]
    )
    top = set(rest[first[rest].topk(9).indices].tolist())
    assert got.selected == 15 and set(got.recomputed) == top | lead | {5, 26, 47}
    full = blend_prefix(model, KWARG, prefix, len(head), placed, 1.0, "early-question", tail)
    assert _max_diff(full.layers, _kv(model, prefix, 0)) < 1e-4


def test_question_selection_always_recomputes_each_pieces_leading_tokens(monkeypatch):
    """EPIC (arXiv 2410.15332): a piece computed alone keeps an attention sink at its first
    tokens; the question-driven selection takes them first, whatever the question attends."""
    model, head, prefix, placed = _three_pieces()
    tail = random_prompt(6, seed=9)
    starts = [p.start for p in placed]  # 6, 27, 48: right after each label
    for lead_tokens, share in ((8, 0.5), (3, 0.25), (3, 0.5), (1, 0.1)):
        monkeypatch.setattr(blend, "LEAD_TOKENS", lead_tokens)
        for select in ("question", "both"):
            got = blend_prefix(model, KWARG, prefix, len(head), placed, share, select, tail)
            budget = got.selected if select == "question" else got.selected // 2
            lead = blend.leading_positions(placed, len(head)).tolist()
            assert set(lead[:budget]) <= set(got.recomputed)
            if budget >= len(lead):
                assert {s + i for s in starts for i in range(lead_tokens)} <= set(got.recomputed)
    # a short budget spreads over the pieces: each piece's first token comes first
    monkeypatch.setattr(blend, "LEAD_TOKENS", 8)
    assert blend.leading_positions(placed, len(head)).tolist()[:3] == starts
    one = blend_prefix(model, KWARG, prefix, len(head), placed, 0.05, "question", tail)
    assert one.selected == 3 and set(one.recomputed) == {5, 26, 47, *starts}
    # the whole share is still the cold prefix
    full = blend_prefix(model, KWARG, prefix, len(head), placed, 1.0, "question", tail)
    assert _max_diff(full.layers, _kv(model, prefix, 0)) < 1e-4


def test_leading_selection_recomputes_each_pieces_first_tokens_without_a_ranking_pass(
    monkeypatch,
):
    """EPIC's static positions: the share goes to each piece's first tokens, spread over the
    pieces, and no pass ranks anything (neither the question's attention nor a deviation)."""
    model, head, prefix, placed = _three_pieces()

    def ranking(*args, **kwargs):
        raise AssertionError("the leading selection ran a ranking pass")

    monkeypatch.setattr(blend, "question_attention", ranking)
    monkeypatch.setattr(blend, "_by_deviation", ranking)
    got = blend_prefix(model, KWARG, prefix, len(head), placed, 0.2, "leading")
    body = [i for p in placed for i in range(p.start, p.start + p.length)]
    chosen = sorted(set(got.recomputed) & set(body))
    assert len(chosen) == got.selected == math.ceil(0.2 * len(body))
    per_piece = [sum(p.start <= i < p.start + p.length for i in chosen) for p in placed]
    assert max(per_piece) - min(per_piece) <= 1  # spread over the pieces
    assert all(
        i - p.start < max(per_piece)
        for p in placed
        for i in chosen
        if p.start <= i < p.start + p.length
    )
    full = blend_prefix(model, KWARG, prefix, len(head), placed, 1.0, "leading")
    assert _max_diff(full.layers, _kv(model, prefix, 0)) < 1e-4


def test_a_kept_head_blends_as_a_fresh_one():
    model = tiny_model("llama")
    install_runtime_attention(model)
    head = random_prompt(5, seed=2)
    bodies = [random_prompt(20, seed=3 + i) for i in range(3)]
    prefix, placed = _placed(model, head, bodies, [1, 2, 0])
    tail = random_prompt(6, seed=9)
    kept = head_kv(model, KWARG, head)
    before = [(k.clone(), v.clone()) for k, v in kept]
    fresh = blend_prefix(model, KWARG, prefix, len(head), placed, 0.25, "question", tail)
    again = blend_prefix(model, KWARG, prefix, len(head), placed, 0.25, "question", tail, kept)
    assert again.recomputed == fresh.recomputed and _max_diff(again.layers, fresh.layers) < 1e-6
    assert _max_diff(kept, before) == 0  # blending leaves the kept head as it was
    pieces = document_pieces(model, KWARG, head, bodies, kept)
    assert _max_diff(pieces[0], document_pieces(model, KWARG, head, bodies)[0]) < 1e-6


# -- the tier, on a tiny model through the engine -------------------------------------


def _words(seed: int, n: int = 30) -> str:
    rng = random.Random(seed)
    return " ".join(f"t{rng.randint(2, 95)}" for _ in range(n))


DOCS = [Document(id=f"d{i}", title=f"t{10 + i}", text=_words(i)) for i in range(4)]
OPTS = AnswerOptions(
    press=SnapKVPress(budget=48, window=8),
    generation=GenerationConfig(max_new_tokens=8),
    document_order="given",  # the tests choose the orders
)


def _engine_loaded(arch: str) -> LoadedModel:
    return LoadedModel(
        model=tiny_model(arch),
        tokenizer=tiny_tokenizer(),
        model_id=f"tiny-{arch}",
        revision="random",
        device=torch.device("cpu"),
    )


def _engine(tmp_path, arch: str = "llama", share: float = 0.15, **kwargs) -> RagSnapEngine:
    loaded = _engine_loaded(arch)
    store = open_store(f"file://{tmp_path}")
    return RagSnapEngine(loaded, store=store, recompute_share=share, **kwargs)


def _doc_files(tmp_path, namespace: str = "default") -> list:
    return sorted((tmp_path / namespace).glob(f"{KIND_DOCUMENT}-*"))


def test_entries_are_shared_across_questions_and_orders(tmp_path):
    eng = _engine(tmp_path)
    first = eng.answer("t5 t6 t7", DOCS[:3], OPTS).stats
    assert (first.cache, first.cache_tier, first.reused_documents) == ("miss", "cold", 0)
    assert len(_doc_files(tmp_path)) == 3  # one piece per document, stored after the answer
    again = eng.answer("t8 t9", [DOCS[2], DOCS[0], DOCS[1]], OPTS).stats
    assert (again.cache, again.cache_tier, again.reused_documents) == (
        "document-hit",
        "documents",
        3,
    )
    assert 3 <= again.recomputed_tokens < again.prompt_tokens // 2
    assert again.prefill_tokens < first.prefill_tokens
    # a new combination: two pieces reused, the third computed alone on the spot and stored
    mixed = eng.answer("t8 t9", [DOCS[3], DOCS[1], DOCS[0]], OPTS).stats
    assert (mixed.cache_tier, mixed.reused_documents) == ("documents", 2)
    assert len(_doc_files(tmp_path)) == 4
    exact = eng.answer("t8 t9", [DOCS[2], DOCS[0], DOCS[1]], OPTS).stats
    assert (exact.cache, exact.cache_tier) == ("hit", "exact")  # exact hit first
    # the prompt head's KV is computed once by the tier and kept for later assemblies
    assert eng.tiers is not None and eng.tiers.documents is not None
    eng.executor._head = None
    heads: list[tuple[int, ...]] = []
    compute_head = eng.runtime.head_kv
    eng.runtime.head_kv = lambda ids: heads.append(tuple(ids)) or compute_head(ids)  # type: ignore[method-assign]
    for question, order in (("t3 t4", [1, 3, 2]), ("t5 t2", [2, 1, 3])):
        later = eng.answer(question, [DOCS[i] for i in order], OPTS).stats
        assert later.cache_tier == "documents"
    assert len(heads) == 1


def test_full_share_answers_as_the_cold_run(tmp_path):
    eng = _engine(tmp_path, share=1.0)
    eng.answer("t5 t6 t7", DOCS[:3], OPTS)
    order = [DOCS[1], DOCS[2], DOCS[0]]
    reused = eng.answer("t8 t9", order, OPTS)
    assert reused.stats.cache_tier == "documents"
    cold = RagSnapEngine(eng.loaded).answer("t8 t9", order, OPTS)
    assert cold.stats.cache_tier == "off"
    assert reused.answer == cold.answer and reused.stats.new_tokens == cold.stats.new_tokens


def test_damaged_and_stale_pieces_are_misses(tmp_path):
    eng = _engine(tmp_path)
    eng.answer("t5 t6 t7", DOCS[:3], OPTS)
    files = _doc_files(tmp_path)
    raw = bytearray(files[0].read_bytes())
    raw[-5] ^= 0xFF  # damaged: the checksum fails
    files[0].write_bytes(bytes(raw))
    digest = files[1].name.removeprefix(f"{KIND_DOCUMENT}-").removesuffix(".kv")
    key = EntryKey("default", KIND_DOCUMENT, digest)
    payload = eng.store.get(key)
    eng.store.put(key, payload.replace(b'"format_version":"1"', b'"format_version":"0"'))  # stale
    stats = eng.answer("t8 t9", [DOCS[2], DOCS[1], DOCS[0]], OPTS).stats
    # one piece of three left: below MIN_REUSED_SHARE, so a cold prefill
    assert (stats.cache, stats.cache_tier, stats.reused_documents) == ("miss", "cold", 0)
    assert eng.store.rejections.get("stale") == 1 and sum(eng.store.rejections.values()) == 2
    assert len(_doc_files(tmp_path)) == 3  # both recomputed and stored again
    stats = eng.answer("t8", [DOCS[1], DOCS[0], DOCS[2]], OPTS).stats
    assert (stats.cache_tier, stats.reused_documents) == ("documents", 3)
    for f in _doc_files(tmp_path):
        f.write_bytes(b"garbage")
    cold = eng.answer("t9", [DOCS[0], DOCS[2], DOCS[1]], OPTS).stats
    assert (cold.cache, cold.cache_tier, cold.reused_documents) == ("miss", "cold", 0)


def test_namespaces_never_share_pieces(tmp_path):
    eng = _engine(tmp_path)
    list(eng.stream("t5 t6 t7", DOCS[:3], OPTS, namespace="alice"))
    done = list(eng.stream("t8 t9", DOCS[:3][::-1], OPTS, namespace="bob"))[-1]
    assert (done.stats.cache_tier, done.stats.reused_documents) == ("cold", 0)
    done = list(eng.stream("t8 t9", DOCS[:3][::-1], OPTS, namespace="alice"))[-1]
    assert (done.stats.cache_tier, done.stats.reused_documents) == ("documents", 3)


def test_sliding_window_models_fall_back_and_say_so(tmp_path):
    eng = _engine(tmp_path, arch="gemma3")
    eng.answer("t5", DOCS[:2], OPTS)
    stats = eng.answer("t6", DOCS[:2][::-1], OPTS).stats
    assert (stats.cache, stats.cache_tier) == ("miss", "cold")
    assert "sliding" in (stats.reuse_note or "")
    assert not _doc_files(tmp_path)


def test_tier_can_be_switched_off(tmp_path):
    eng = _engine(tmp_path, document_cache=False)
    eng.answer("t5", DOCS[:2], OPTS)
    assert eng.answer("t6", DOCS[:2][::-1], OPTS).stats.cache_tier == "cold"
    assert not _doc_files(tmp_path)


def test_metrics_count_tiers():
    from ragsnap.api.metrics import ServiceMetrics
    from ragsnap.engine.stats import AnswerStats

    metrics = ServiceMetrics()
    fields = {
        f: 0 for f in AnswerStats.__dataclass_fields__ if f not in {"model", "device", "press"}
    }
    fields.update(press_config={}, kept_tokens_per_layer=[], budget=None, citations_mode="markers")
    stats = AnswerStats(model="m", device="cpu", press="snapkv", **fields)
    stats.cache, stats.cache_tier, stats.reused_documents, stats.recomputed_tokens = (
        "document-hit",
        "documents",
        7,
        120,
    )
    stats.decode_ms_per_token = None
    metrics.observe_answer(stats)
    text = metrics.render().decode()
    assert 'ragsnap_cache_tier_total{tier="documents"} 1.0' in text
    assert "ragsnap_reused_documents_total 7.0" in text
    assert "ragsnap_recomputed_tokens_total 120.0" in text


# -- the embedded model ---------------------------------------------------------------


@pytest.mark.model
def test_reencoding_is_exact_on_the_embedded_model(engine):
    ids = engine.tokenizer("Tides are caused mainly by the gravity of the Moon.")["input_ids"]
    _assert_reencoding_exact(engine.loaded.model, list(ids), offset=300)


@pytest.mark.model
def test_full_share_is_the_cold_answer_on_the_embedded_model(engine, tmp_path):
    docs = [
        Document(
            id="tides", title="Tides", text="Tides are caused mainly by the gravity of the Moon."
        ),
        Document(
            id="bees",
            title="Honeybees",
            text="Honeybees dance in the hive to show where flowers are.",
        ),
        Document(
            id="salt", title="Salt", text="The Dead Sea is so salty that people float on it easily."
        ),
    ]
    opts = AnswerOptions(
        press=SnapKVPress(budget=64, window=8),
        generation=GenerationConfig(max_new_tokens=12),
        document_order="given",
    )
    eng = RagSnapEngine(
        engine.loaded,
        store=open_store(f"file://{tmp_path}"),
        document_cache=True,
        recompute_share=1.0,
    )
    eng.answer("What causes tides?", docs, opts)
    order = [docs[2], docs[0], docs[1]]
    reused = eng.answer("Why do people float in the Dead Sea?", order, opts)
    assert (reused.stats.cache_tier, reused.stats.reused_documents) == ("documents", 3)
    cold = engine.answer("Why do people float in the Dead Sea?", order, opts)
    assert reused.answer == cold.answer


def test_pieces_in_redis_carry_the_store_ttl_and_are_reused(redis_server):
    from ragsnap.cache.backends.redis_store import RedisKVStore

    store = RedisKVStore.from_url(redis_server.url + "?ttl=120")
    loaded = _engine_loaded("llama")
    eng = RagSnapEngine(loaded, store=store, document_cache=True)
    namespace = f"reuse-{random.randrange(10**9)}"
    list(eng.stream("t5 t6 t7", DOCS[:3], OPTS, namespace=namespace))
    manifests = store.client.keys(f"ragsnap:v1:{namespace}:{KIND_DOCUMENT}:*:manifest")
    assert len(manifests) == 3
    assert all(0 < store.client.ttl(k) <= 120 for k in manifests)
    done = list(eng.stream("t8", DOCS[:3][::-1], OPTS, namespace=namespace))[-1]
    assert (done.stats.cache_tier, done.stats.reused_documents) == ("documents", 3)
    assert done.stats.cache_bytes_read > 0


@pytest.mark.model
def test_bench_reuse_serves_every_share_from_the_tier(engine, tmp_path, capsys, monkeypatch):
    from ragsnap.cli import main

    monkeypatch.setattr("ragsnap.engine.loading.plain_runtime", lambda **k: engine.runtime)
    rng = random.Random(5)
    topics = ["river", "castle", "comet", "violin", "glacier", "harbor"]
    records = [
        {
            "_id": topic,
            "question": f"What is said about the {topic}?",
            "answer": f"the {topic}",
            "title_a": topic.title(),
            "para_a": [
                f"The {topic} number {rng.randint(1, 999)} lies {rng.randint(2, 90)} miles "
                f"from the {rng.choice(topics)}. "
                for _ in range(25)
            ],
            "title_b": f"Old {topic}",
            "para_b": [f"The {topic} is old."],
            "distractors": [],
        }
        for topic in topics
    ]
    data = tmp_path / "hotpot.json"
    data.write_text(json.dumps(records))
    argv = ["bench", "reuse", "--data", str(data), "--pool", "4", "--docs", "2"]
    argv += ["--questions", "2", "--context", "512", "--budget", "64", "--max-new-tokens", "4"]
    argv += ["--shares", "0,0.5,1", "--select", "question,deviation", "--json"]
    assert main(argv) == 0  # a share the tier did not serve is an error
    out = json.loads(capsys.readouterr().out)
    assert out["questions"] == 2 and out["select"] == ["question", "deviation"]
    shares = out["shares"]
    assert set(shares) == {"0.0", "question@0.5", "deviation@0.5", "1.0"}
    recomputed = [shares[k]["recomputed_tokens_mean"] for k in ("0.0", "question@0.5", "1.0")]
    assert recomputed[0] < recomputed[1] < recomputed[2]
    assert (
        shares["question@0.5"]["recomputed_tokens_mean"]
        == (shares["deviation@0.5"]["recomputed_tokens_mean"])
    )
    assert shares["0.0"]["kl_over_concat"] == 1.0


def test_by_default_seen_documents_are_served_from_the_tiers(tmp_path):
    """Issue 44: under the default relevance order a new question re-orders the documents;
    with default settings (the per-document tier is on) it is still served from the tiers,
    and so is a new combination of seen passages."""
    eng = RagSnapEngine(_engine_loaded("llama"), store=open_store(f"file://{tmp_path}"))
    assert eng.config.document_cache
    opts = AnswerOptions(
        press=SnapKVPress(budget=48, window=8), generation=GenerationConfig(max_new_tokens=4)
    )
    assert opts.document_order == "relevance"
    first = eng.answer("t5 t6 t7", DOCS, opts).stats
    assert (first.cache, first.cache_tier) == ("miss", "cold")
    for question, docs in (
        ("t12 t13 t9", DOCS),  # a second question over the same document set
        ("t8 t11", [DOCS[3], DOCS[0], DOCS[2]]),  # a new combination of seen passages
    ):
        stats = eng.answer(question, docs, opts).stats
        assert stats.cache in ("prefix-hit", "document-hit"), (question, stats.cache)
        assert stats.cache_tier in ("prefix", "documents")
