"""``ragsnap bench overhead``'s estimator: paired differences within a round (no servers)."""

from __future__ import annotations

import argparse
import itertools

import pytest

from ragsnap.cli.bench import overhead


def test_paired_gaps_cancel_a_slow_moment_that_both_paths_see(monkeypatch):
    # round r: the machine adds `slow[r]` seconds to both paths; Ray is 10 ms slower
    slow = itertools.cycle([0.0, 0.0, 0.0, 0.5, 0.5])
    calls = itertools.count()
    moment = {"slow": 0.0}

    def fake_time(url, body):
        if next(calls) % 2 == 0:  # a new round starts with the first path
            moment["slow"] = next(slow)
        extra = 0.010 if url == "ray" else 0.0
        return 1.0 + moment["slow"] + extra, body.get("max_new_tokens", 1), 40.0

    monkeypatch.setattr(overhead, "_time", fake_time)
    urls = {"in_process": "local", "ray": "ray"}
    run = overhead._medians(urls, {"max_new_tokens": 1}, rounds=5)
    assert run["median_gap_s"] == {"in_process": 0.0, "ray": 0.01}
    assert run["decode_ms_per_token"] == {"in_process": 40.0, "ray": 40.0}


def test_per_chunk_is_the_long_streams_extra_gap_per_extra_token():
    def run(gap_s: float, tokens: int) -> dict:
        gaps = {"in_process": 0.0, "ray": gap_s, "ray_proxy": 2 * gap_s}
        return {
            "median_s": {},
            "median_gap_s": gaps,
            "gaps_s": {path: [g] * 5 for path, g in gaps.items()},  # every round alike
            "tokens": {"in_process": tokens, "ray": tokens, "ray_proxy": tokens},
        }

    args = argparse.Namespace(model="tiny", rounds=3)
    out = overhead.summarize(args, run(0.006, 1), run(0.004, 1), run(0.024, 21))
    assert out["per_request_ms"] == 6.0
    assert out["per_chunk_ms"] == 1.0  # (24 - 4) ms over 20 extra tokens
    assert out["per_chunk_ms_90"] == [1.0, 1.0]  # no spread between rounds: no doubt
    assert out["via_proxy"] == {
        "per_request_ms": 12.0,
        "per_chunk_ms": 2.0,
        "per_chunk_ms_90": [2.0, 2.0],
    }


def test_per_chunk_interval_is_exact_without_noise_and_widens_with_it():
    # long stream: 20 extra tokens, 20 ms more gap than the one-token stream -> 1 ms/chunk
    assert overhead.chunk_interval([0.024] * 9, [0.004] * 9, 20) == pytest.approx((1.0, 1.0))
    noisy_long = [0.024 + d for d in (-0.06, -0.03, 0.0, 0.0, 0.0, 0.03, 0.06, 0.09, -0.09)]
    low, high = overhead.chunk_interval(noisy_long, [0.004] * 9, 20)
    assert low < 1.0 < high
    assert high - low > 1.0  # 30-90 ms of spread per round is more than 1 ms per chunk
