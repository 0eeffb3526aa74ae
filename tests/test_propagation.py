"""Query-aware prefill (issue 39): the layer-split forward, its selection and its contract.

p = 1 reproduces the full path (kept indices, greedy answer); propagated tokens keep their
original positions; the window and forced positions always propagate; bad settings name
their field; presses that need every query take the full path; cancellation stops at a
chunk boundary in both phases; batched rows decode as alone.
"""

from __future__ import annotations

import pytest
import torch

from ragsnap.compression import make_press
from ragsnap.compression.propagate import PropagatePress, propagation_of, without_propagation
from ragsnap.errors import ConfigError
from ragsnap.runtime.generation import GenerationConfig
from ragsnap.runtime.propagation import select_tokens
from tests.tiny_models import ARCHITECTURES, random_prompt, tiny_engine

LENGTH = 150


def _pair(name: str, share: float, layer: int = 2, **options):
    base = make_press(name, budget=40, window=8, **options)
    prop = make_press(
        name, budget=40, window=8, propagate_layer=layer, propagate_share=share, **options
    )
    return base, prop


def _answer(runtime, prefill, tokens: int = 10) -> list[int]:
    return runtime.generate(prefill, GenerationConfig(max_new_tokens=tokens))


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("chunk", [None, 40])
def test_share_one_reproduces_the_full_path(arch, chunk) -> None:
    engine = tiny_engine(arch)
    engine.runtime.chunk = chunk
    prompt = random_prompt(LENGTH, seed=3)
    for name in ("snapkv", "ragsnap-lookahead"):
        base, prop = _pair(name, 1.0)
        full = engine.runtime.prefill(prompt, base)
        split = engine.runtime.prefill(prompt, prop)
        assert split.prefill_path == "propagate" and split.propagated_tokens == LENGTH
        assert full.prefill_path == "full" and full.full_path_reason is None
        assert len(full.kept) == len(split.kept)
        for a, b in zip(full.kept, split.kept, strict=True):
            assert torch.equal(a.indices, b.indices)
        assert _answer(engine.runtime, full) == _answer(engine.runtime, split)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_propagated_tokens_keep_their_original_positions(arch) -> None:
    """Layer s's input is layer s-1's output, identical on both paths: so its keys (RoPE at
    the token's position) equal the full path's keys at the propagated positions."""
    engine = tiny_engine(arch)
    prompt = random_prompt(120, seed=5)
    full = engine.runtime.prefill(prompt, make_press("full"))
    split = engine.runtime.prefill(
        prompt, make_press("full", propagate_layer=2, propagate_share=0.4)
    )
    assert split.prefill_path == "propagate"
    n = split.propagated_tokens
    assert n == 48
    positions = split.kept[2].indices[0, 0]  # the full press keeps every propagated token
    assert positions.shape[0] == n and bool((positions.diff() > 0).all())
    for layer in (0, 1):  # lower layers: every token
        assert torch.equal(split.kept[layer].indices, full.kept[layer].indices)
        assert torch.equal(split.layers[layer][0], full.layers[layer][0])
    assert split.layers[2][0].shape[2] == n and split.layers[3][0].shape[2] == n
    expected = full.layers[2][0][:, :, positions]
    torch.testing.assert_close(split.layers[2][0], expected, rtol=1e-5, atol=1e-5)
    # and decoding continues after the prompt's last original position
    assert len(_answer(engine.runtime, split, 5)) == 5


def test_window_and_forced_positions_always_propagate() -> None:
    engine = tiny_engine("llama")
    prompt = random_prompt(160, seed=7)
    forced = torch.zeros(160, dtype=torch.bool)
    forced[:12] = True  # an instruction
    forced[60:63] = True  # a document header
    result = engine.runtime.prefill(
        prompt,
        make_press("snapkv", budget=24, window=8, propagate_layer=1, propagate_share=0.2),
        forced=forced,
    )
    assert result.prefill_path == "propagate" and result.propagated_tokens == 32
    # every upper-layer kept index is a propagated position; window kept in every layer
    for layer in result.kept:
        idx = layer.indices[0]
        assert bool((idx[:, -8:] == torch.arange(152, 160)).all())
    propagated = (
        engine.runtime.prefill(
            prompt, make_press("full", propagate_layer=1, propagate_share=0.2), forced=forced
        )
        .kept[1]
        .indices[0, 0]
    )
    kept = set(propagated.tolist())
    assert set(range(12)) | {60, 61, 62} | set(range(128, 160)) - set(range(128, 152)) <= kept


def test_select_tokens_ranks_votes_after_forced_and_window() -> None:
    votes = torch.tensor([0.1, 0.9, 0.2, 0.8, 0.0, 0.3])  # 6 prefix positions, window 2
    forced = torch.zeros(8, dtype=torch.bool)
    forced[4] = True
    picked = select_tokens(votes, 8, keep=5, forced=forced)
    assert picked.tolist() == [1, 3, 4, 6, 7]
    # never fewer than what must propagate, never more than the prompt
    assert select_tokens(votes, 8, keep=1, forced=forced).tolist() == [4, 6, 7]
    assert select_tokens(votes, 8, keep=99, forced=forced).tolist() == list(range(8))


def test_share_never_goes_below_what_the_budget_needs() -> None:
    engine = tiny_engine("llama")
    prompt = random_prompt(200, seed=2)
    press = make_press("snapkv", budget=80, window=8, propagate_layer=2, propagate_share=0.1)
    result = engine.runtime.prefill(prompt, press)
    assert result.propagated_tokens == 80
    assert result.kept_tokens_per_layer == [80, 80, 80, 80]


def test_bad_values_name_their_field() -> None:
    for share in (0.0, -0.5, 1.5):
        with pytest.raises(ConfigError) as info:
            make_press("snapkv", budget=40, propagate_layer=1, propagate_share=share)
        assert info.value.field == "propagate_share"
    with pytest.raises(ConfigError) as info:
        make_press("snapkv", budget=40, propagate_layer=0, propagate_share=0.5)
    assert info.value.field == "propagate_layer"
    engine = tiny_engine("llama")  # 4 layers: s must be 1..3
    too_deep = make_press("snapkv", budget=40, window=8, propagate_layer=4, propagate_share=0.5)
    with pytest.raises(ConfigError) as info:
        engine.runtime.prefill(random_prompt(100), too_deep)
    assert info.value.field == "propagate_layer" and "between 1 and 3" in str(info.value)


def test_a_press_that_needs_every_query_takes_the_full_path_and_says_so() -> None:
    engine = tiny_engine("llama")
    prompt = random_prompt(120, seed=1)
    press = make_press("h2o", budget=40, propagate_layer=2, propagate_share=0.3)
    result = engine.runtime.prefill(prompt, press)
    assert result.prefill_path == "full" and "every prompt query" in result.full_path_reason
    plain = engine.runtime.prefill(prompt, make_press("h2o", budget=40))
    for a, b in zip(plain.kept, result.kept, strict=True):
        assert torch.equal(a.indices, b.indices)


def test_sliding_layers_past_the_split_take_the_full_path_below_share_one() -> None:
    engine = tiny_engine("gemma3")  # layer 2 slides
    result = engine.runtime.prefill(random_prompt(100), _pair("snapkv", 0.5)[1])
    assert result.prefill_path == "full" and "sliding" in result.full_path_reason


def test_the_path_is_part_of_the_press_config_and_the_switch_removes_it() -> None:
    base, prop = _pair("ragsnap-lookahead", 0.3)
    assert "propagate" not in base.config()
    assert prop.config()["propagate"] == {"layer": 2, "share": 0.3}
    assert propagation_of(prop) is not None
    assert without_propagation(prop).config() == base.config()
    named = make_press("ragsnap-propagate", budget=40, window=8)
    assert isinstance(named, PropagatePress) and named.config()["propagate"]["layer"] == "auto"
    assert len(named.config()["propagate"]["calibration"]) == 16  # auto follows the packaged


def test_exact_hit_keys_differ_between_paths() -> None:
    from ragsnap.cache.keys import compressed_key

    def key(press):
        return compressed_key(
            "ns",
            model={"id": "tiny"},
            template_version="t",
            press_config=press.config(),
            doc_hashes=["h"],
            question="q",
            prompt_ids=[1, 2, 3],
        )

    base, half = _pair("snapkv", 0.5)
    assert len({key(base), key(half), key(_pair("snapkv", 0.6)[1])}) == 3
    assert key(_pair("snapkv", 0.5, layer=3)[1]) != key(half)


@pytest.mark.parametrize("cancel_at", [2, 5])
def test_cancellation_stops_at_a_chunk_boundary_in_both_phases(cancel_at) -> None:
    """200 tokens in 40-token chunks: 5 lower passes (on_chunk after the first 4), then 80
    propagated tokens in 2 upper passes (on_chunk after the first): call 2 is in the lower
    phase, call 5 in the upper one."""
    engine = tiny_engine("llama")
    engine.runtime.chunk = 40
    model = engine.runtime.model
    passes: list[str] = []
    handles = [
        model.model.layers[0].register_forward_hook(lambda *_: passes.append("lower")),
        model.model.layers[3].register_forward_hook(lambda *_: passes.append("upper")),
    ]
    calls: list[int] = []

    def on_chunk() -> None:
        calls.append(len(passes))
        if len(calls) == cancel_at:
            raise KeyboardInterrupt

    press = make_press("snapkv", budget=40, window=8, propagate_layer=2, propagate_share=0.4)
    try:
        with pytest.raises(KeyboardInterrupt):
            engine.runtime.prefill(random_prompt(200, seed=4), press, on_chunk=on_chunk)
    finally:
        for handle in handles:
            handle.remove()
    assert len(calls) == cancel_at
    expected = ["lower"] * cancel_at if cancel_at <= 4 else ["lower"] * 5 + ["upper"]
    assert passes == expected  # nothing ran after the cancelling boundary
    # the model is free: no hook of the split is left, and a new prefill matches a fresh one
    for layer in model.model.layers:
        assert not layer._forward_hooks and not layer.self_attn._forward_hooks
    again = engine.runtime.prefill(random_prompt(200, seed=4), press)
    fresh = tiny_engine("llama")
    fresh.runtime.chunk = 40
    reference = fresh.runtime.prefill(random_prompt(200, seed=4), press)
    for a, b in zip(again.kept, reference.kept, strict=True):
        assert torch.equal(a.indices, b.indices)


def test_batched_rows_on_both_paths_decode_exactly_as_alone() -> None:
    engine = tiny_engine("llama")
    runtime = engine.runtime
    requests = []
    for i, share in enumerate((None, 0.3, 0.6, 1.0)):
        if share is None:
            press = make_press("ragsnap", budget=32, window=8)
        else:
            press = make_press(
                "ragsnap", budget=32, window=8, propagate_layer=1 + i % 3, propagate_share=share
            )
        prefill = runtime.prefill(random_prompt(100 + 20 * i, seed=i), press)
        requests.append((prefill, GenerationConfig(max_new_tokens=6 + i)))
    assert [r[0].prefill_path for r in requests] == ["full"] + ["propagate"] * 3

    def decode(batch_requests):
        batch = runtime.decode_batch(set())
        rows = [batch.add(i, p, g) for i, (p, g) in enumerate(batch_requests)]
        for _ in batch.run():
            pass
        return [r.tokens for r in rows]

    alone = [decode([r])[0] for r in requests]
    assert decode(requests) == alone


@pytest.mark.model
def test_share_one_reproduces_the_full_path_on_the_embedded_model(engine) -> None:
    from ragsnap.prompt.documents import Document as Doc

    layout = engine.build_prompt(
        "Which river flows through the capital?",
        [
            Doc(id="f", text="The capital of Freedonia is Marlow. " * 20, title="Freedonia"),
            Doc(id="o", text="The Ost river flows through Marlow, by the mill. " * 12, title="Ost"),
        ],
        GenerationConfig(max_new_tokens=12),
    )
    # the whole prompt in one computation on both paths (prefill_prompt's full path at
    # medium matmul precision splits documents and tail; the query-aware one cannot)
    chunk = engine.runtime.chunk
    try:
        for size, name in ((None, "ragsnap-lookahead"), (128, "snapkv")):
            engine.runtime.chunk = size
            if True:
                base = make_press(name, budget=64)
                prop = make_press(name, budget=64, propagate_layer=12, propagate_share=1.0)
                full = engine.runtime.prefill(layout.input_ids, base)
                split = engine.runtime.prefill(layout.input_ids, prop)
                assert split.prefill_path == "propagate"
                assert split.propagated_tokens == layout.num_tokens
                for a, b in zip(full.kept, split.kept, strict=True):
                    assert torch.equal(a.indices, b.indices)
                assert _answer(engine.runtime, full, 12) == _answer(engine.runtime, split, 12)
    finally:
        engine.runtime.chunk = chunk


def test_cli_options_turn_propagation_on_and_the_switch_forces_the_full_path(monkeypatch) -> None:
    import argparse

    from ragsnap.cli.options import add_press_options, press_from_args
    from ragsnap.engine.options import config_from_args

    parser = argparse.ArgumentParser()
    add_press_options(parser)

    def press(*argv):
        args = parser.parse_args(list(argv))
        return press_from_args(args, config_from_args(args))

    monkeypatch.delenv("RAGSNAP_FULL_PREFILL", raising=False)
    on = press("--press", "snapkv", "--budget", "64", "--propagate-share", "0.3")
    assert on.config()["propagate"]["layer"] == "auto" and on.config()["propagate"]["share"] == 0.3
    named = press("--press", "ragsnap-propagate", "--propagate-layer", "9")
    assert named.config()["propagate"]["layer"] == 9
    assert propagation_of(press("--press", "ragsnap-propagate", "--full-prefill")) is None
    monkeypatch.setenv("RAGSNAP_FULL_PREFILL", "1")
    assert propagation_of(press("--press", "ragsnap-propagate")) is None
    with pytest.raises(ConfigError) as info:
        press("--press", "snapkv", "--propagate-share", "1.5")
    assert info.value.field == "propagate_share"


def test_api_request_field_and_setting_force_the_full_path() -> None:
    from pydantic import ValidationError

    from ragsnap.api.answering import answer_options
    from ragsnap.api.schemas import CompressionIn
    from ragsnap.api.settings import Settings

    def options(settings=None, **fields):
        return answer_options(
            CompressionIn(press="ragsnap-propagate", **fields),
            settings or Settings(),
            max_new_tokens=8,
            temperature=None,
            top_p=None,
            seed=None,
        )

    assert propagation_of(options().press) is not None
    assert options(propagate_layer=5).press.config()["propagate"]["layer"] == 5
    assert propagation_of(options(full_prefill=True).press) is None
    assert propagation_of(options(Settings(full_prefill=True)).press) is None
    for field, value in (("propagate_layer", 0), ("propagate_share", 0.0)):
        with pytest.raises(ValidationError) as info:  # the app answers 422 naming it
            CompressionIn(**{field: value})
        assert info.value.errors()[0]["loc"] == (field,)


def test_a_new_document_set_takes_the_fast_path_and_a_recurring_one_gets_its_prefix(
    tmp_path,
) -> None:
    from ragsnap.cache import open_store
    from ragsnap.engine.engine import AnswerOptions, RagSnapEngine
    from ragsnap.prompt.documents import Document

    # the prefix tier alone (the per-document tier, on by default, would serve the repeat)
    engine = RagSnapEngine(
        tiny_engine("llama").loaded, store=open_store(f"file://{tmp_path}"), document_cache=False
    )
    words = random_prompt(240, seed=9)
    docs = [
        Document(id="a", title="t3", text=" ".join(f"t{t}" for t in words[:120])),
        Document(id="b", title="t4", text=" ".join(f"t{t}" for t in words[120:])),
    ]
    press = make_press("snapkv", budget=24, window=8, propagate_layer=2, propagate_share=0.5)
    opts = AnswerOptions(
        press=press, generation=GenerationConfig(max_new_tokens=4), document_order="given"
    )

    def stats(question):
        return engine.answer(question, docs, opts).stats

    first = stats("t5 t6 t7")
    assert (first.cache, first.prefill_path) == ("miss", "propagate")
    assert first.propagated_tokens is not None and first.propagated_tokens < first.prompt_tokens
    second = stats("t8 t9 t10")  # the set recurs: full prefill, its prefix entry stored
    assert (second.cache, second.prefill_path) == ("miss", "full")
    third = stats("t11 t12 t13")
    assert (third.cache, third.prefill_path) == ("prefix-hit", "full")
    assert "prefix" in third.full_path_reason
    again = stats("t5 t6 t7")  # the first question's entry: an exact hit
    assert again.cache == "hit"
