"""Decode-phase SnapKV: a row's cache stays within its slack, re-selection keeps what it
says, and rows that do not use it decode as before."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from ragsnap.compression import make_press
from ragsnap.compression.decode_snapkv import DecodeSnapKV, DecodeVotes
from ragsnap.errors import ConfigError
from ragsnap.runtime.generation import GenerationConfig
from tests.tiny_models import random_prompt, tiny_engine

LONG = GenerationConfig(max_new_tokens=40)


def _prefill(engine, length=80, press="snapkv", budget=24):
    options = {"budget": budget, "window": 8}
    return engine.runtime.prefill(random_prompt(length, seed=length), make_press(press, **options))


def test_settings_are_checked():
    with pytest.raises(ConfigError, match="decode window"):
        DecodeSnapKV(slack=8, window=16)
    with pytest.raises(ConfigError, match="odd"):
        DecodeSnapKV(kernel=4)


def test_selection_keeps_the_recent_tail_and_the_most_voted_entries():
    votes = DecodeVotes(DecodeSnapKV(slack=4, window=2, kernel=1), targets=[5])
    step = torch.zeros(1, 9)  # one query head, one KV head, 9 entries seen
    step[0, 1], step[0, 4], step[0, 6] = 0.5, 0.3, 0.1
    votes.record(0, step, num_kv_heads=1)
    assert votes.due(0, 10)
    kept = votes.select(0, 10)
    assert kept.tolist() == [[1, 4, 6, 8, 9]]  # three best of the first 8, the last two


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_long_answer_stays_within_its_slack(arch):
    engine = tiny_engine(arch)
    prefill = _prefill(engine)
    settings = DecodeSnapKV(slack=8, window=4)
    batch = engine.runtime.decode_batch(stop_ids=set())
    row = batch.add("r", prefill, LONG, decode_compression=settings)
    start = batch.lanes[0].kv.lengths[0].clone()
    longest = start.clone()
    while batch.rows:
        batch.step()
        if batch.rows:
            longest = torch.maximum(longest, batch.lanes[0].kv.lengths[0])
    assert len(row.tokens) == LONG.max_new_tokens
    sliding = [w is not None for w in batch.windows]
    for layer, is_sliding in enumerate(sliding):
        if not is_sliding:  # full-attention layers never pass start + slack
            assert longest[layer] <= start[layer] + settings.slack
    assert any(longest[i] < start[i] + LONG.max_new_tokens for i, s in enumerate(sliding) if not s)


def test_a_compacted_row_decodes_as_a_row_built_from_those_entries():
    engine = tiny_engine("llama")
    prefill = _prefill(engine, press="ragsnap")  # with an Attention Matching bias
    assert prefill.bias
    every_other = [torch.arange(0, k.shape[-2], 2) for k, _ in prefill.layers]
    batch = engine.runtime.decode_batch(stop_ids=set())
    batch.add("r", prefill, LONG)
    for layer, (k, _) in enumerate(prefill.layers):
        batch.lanes[0].kv.compact(0, layer, every_other[layer].expand(k.shape[1], -1))

    def padded_bias(layer: int, b: torch.Tensor) -> torch.Tensor:
        full = b.new_zeros((*b.shape[:2], prefill.layers[layer][0].shape[-2]))
        full[..., : b.shape[-1]] = b
        return full[..., every_other[layer]]

    rebuilt = replace(
        prefill,
        cache=engine.runtime.cache_from(
            [
                (k[:, :, i], v[:, :, i])
                for (k, v), i in zip(prefill.layers, every_other, strict=True)
            ]
        ),
        bias={layer: padded_bias(layer, b) for layer, b in prefill.bias.items()},
    )
    fresh = engine.runtime.decode_batch(stop_ids=set())
    fresh.add("r", rebuilt, LONG)
    for _ in range(5):
        batch.step()
        fresh.step()
    torch.testing.assert_close(batch.rows[0].next_logits, fresh.rows[0].next_logits)
    assert batch.rows[0].tokens == fresh.rows[0].tokens


def test_rows_without_it_decode_exactly_as_alone():
    engine = tiny_engine("llama")
    plain, voting = _prefill(engine, 90), _prefill(engine, 70)
    alone = engine.runtime.decode_batch(stop_ids=set())
    expected = alone.add("p", plain, LONG)
    for _ in alone.run():
        pass
    batch = engine.runtime.decode_batch(stop_ids=set())
    row = batch.add("p", plain, LONG)
    batch.add("v", voting, LONG, decode_compression=DecodeSnapKV(slack=8, window=4))
    for _ in batch.run():
        pass
    assert row.tokens == expected.tokens


def test_a_slack_never_reached_changes_nothing():
    engine = tiny_engine("llama")
    prefill = _prefill(engine)
    runs = []
    for settings in (None, DecodeSnapKV(slack=1000, window=4)):
        batch = engine.runtime.decode_batch(stop_ids=set())
        row = batch.add("r", prefill, LONG, decode_compression=settings)
        for _ in batch.run():
            pass
        runs.append(row.tokens)
    assert runs[0] == runs[1]


@pytest.mark.model
def test_the_service_bounds_a_long_answer_and_names_a_bad_setting(engine):
    import httpx

    from ragsnap.api.app import create_app
    from ragsnap.api.settings import Settings
    from tests.api_helpers import DOCS, FAST, running_server

    body = {"question": "Tell me everything about bees and tides.", "documents": DOCS}
    with running_server(create_app(Settings(), engine=engine)) as url:
        bounded = httpx.post(
            f"{url}/v1/answer",
            json={**body, "max_new_tokens": 48, "compression": {**FAST, "decode_slack": 8}},
            timeout=300,
        )
        refused = httpx.post(
            f"{url}/v1/answer",
            json={**body, "compression": {**FAST, "decode_window": 4}},
            timeout=60,
        )
    assert bounded.status_code == 200, bounded.text
    stats = bounded.json()["stats"]
    assert stats["new_tokens"] > 8 + 1 and stats["decode_reselections"] > 0
    assert refused.status_code == 422
    assert refused.json()["error"]["param"] == "compression.decode_window"


def test_eval_refuses_a_bad_decode_setting_before_loading(tiny, tmp_path, capsys):
    from ragsnap.cli import main

    code = main(
        [
            "eval",
            "--format",
            "niah",
            "--haystack",
            str(tmp_path),
            "--out",
            str(tmp_path / "o"),
            "--decode-slack",
            "8",
            "--decode-window",
            "16",
        ]
    )
    assert code == 2
    assert "decode window" in capsys.readouterr().err
