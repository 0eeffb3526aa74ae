"""Bootstrap intervals, the paired sign test, `ragsnap eval compare` and the plots."""

from __future__ import annotations

import json

import pytest

from ragsnap.cli import build_parser, main
from ragsnap.eval.aggregate import build_runs
from ragsnap.eval.confidence import bootstrap_ci, sign_test
from ragsnap.eval.plots import _series, plot_scores


def test_bootstrap_interval_is_seeded_and_brackets_the_mean():
    values = [0, 1] * 20
    low, high = bootstrap_ci(values)
    assert low < 0.5 < high and high - low < 0.4
    assert bootstrap_ci(values) == (low, high)  # same seed, same interval
    wide = bootstrap_ci([0, 1] * 3)
    assert wide[1] - wide[0] > high - low  # fewer items, wider interval
    assert bootstrap_ci([1.0]) is None and bootstrap_ci([2.0, 2.0]) == (2.0, 2.0)


@pytest.mark.parametrize(("won", "lost"), [(0, 4), (7, 2), (10, 10), (1, 0), (30, 12)])
def test_sign_test_matches_scipy_binomtest(won, lost):
    scipy_stats = pytest.importorskip("scipy.stats")
    expected = scipy_stats.binomtest(won, won + lost, 0.5).pvalue
    assert sign_test(won, lost) == pytest.approx(expected, abs=1e-6)
    assert sign_test(0, 0) is None


def record(item, press, budget, accuracy, kl, agreement=1.0):
    return {
        "item_id": item, "type": "short", "press": press, "budget": budget,
        "question": "q", "answer": "a", "gold_answers": ["a"],
        "scores": {"accuracy": accuracy, "kl": kl, "agreement": agreement},
        "prompt_tokens": 100, "kept_tokens": budget or 100, "stats": {},
    }  # fmt: skip


def _records(kls, accuracy=1.0, press="ragsnap"):
    out = []
    for i, kl in enumerate(kls):
        out += [record(f"i{i}", "full", None, 1.0, 0.0), record(f"i{i}", "snapkv", 64, 1.0, 0.5)]
        out.append(record(f"i{i}", press, 64, accuracy, kl))
    return out


def test_runs_carry_intervals_and_versus_carries_sign_test_p():
    points = [("full", None), ("snapkv", 64), ("ragsnap", 64)]
    runs = build_runs(_records([0.1] * 8), points)
    ragsnap = runs[2]
    assert ragsnap["ci"]["kl"] == [0.1, 0.1] and ragsnap["ci"]["accuracy"] == [1.0, 1.0]
    versus = ragsnap["versus"]
    assert (versus["kl_lower"], versus["kl_higher"]) == (8, 0)
    assert versus["kl_sign_p"] == pytest.approx(2 / 2**8)
    assert versus["accuracy_sign_p"] is None  # no item differs


def _folder(path, records, settings):
    path.mkdir()
    lines = [json.dumps(r) for r in records]
    (path / "predictions.jsonl").write_text("\n".join(lines) + "\n")
    (path / "settings.json").write_text(json.dumps(settings))
    return path


def test_compare_pairs_items_and_names_the_settings_that_differ(tmp_path, capsys):
    grid = [{"press": "full"}, {"press": "snapkv", "window": 32}]
    a = _folder(tmp_path / "a", _records([0.4] * 6), {"seed": 0, "provenance": {"grid": grid}})
    grid_b = [grid[0], {"press": "snapkv", "window": 8}]
    b = _folder(
        tmp_path / "b", _records([0.1] * 5 + [0.9]), {"seed": 0, "provenance": {"grid": grid_b}}
    )
    assert main(["eval", "compare", str(a), str(b), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["shared_items"] == 6
    assert result["settings_differ"] == [{"key": "provenance.grid.1.window", "a": 32, "b": 8}]
    ragsnap = next(p for p in result["points"] if p["press"] == "ragsnap")
    kl = ragsnap["metrics"]["kl"]
    assert (kl["b_lower"], kl["b_higher"]) == (5, 1)
    assert kl["delta"] == pytest.approx((5 * -0.3 + 0.5) / 6, abs=1e-6)
    assert kl["delta_ci"][0] < kl["delta"] < kl["delta_ci"][1]
    assert kl["sign_p"] == pytest.approx(0.21875)
    assert main(["eval", "compare", str(a), str(b)]) == 0
    text = capsys.readouterr().out
    assert "provenance.grid.1.window: A 32  B 8" in text and "ragsnap budget 64 (n=6):" in text


def test_compare_of_runs_without_shared_items_exits_2(tmp_path, capsys):
    a = _folder(tmp_path / "a", _records([0.4]), {})
    b = _folder(tmp_path / "b", [dict(r, item_id="other") for r in _records([0.4])], {})
    assert main(["eval", "compare", str(a), str(b)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ragsnap: error:") and "share no item" in err
    assert main(["eval", "compare", str(a), str(tmp_path / "missing")]) == 2


def test_eval_without_compare_still_parses_and_needs_out(capsys):
    args = build_parser().parse_args(["eval", "--format", "niah", "--haystack", "h", "--out", "o"])
    assert args.handler.__name__ == "run" and args.format == "niah"
    assert main(["eval", "--format", "niah", "--haystack", "h"]) == 2
    assert "needs --out" in capsys.readouterr().err


class _Axes:
    def __init__(self):
        self.calls = []

    def errorbar(self, x, y, **kwargs):
        self.calls.append((x, y, kwargs))


def test_identical_series_get_their_own_x_marker_and_line_style(tmp_path):
    records = _records([0.5] * 3, press="tova")  # tova identical to snapkv
    runs = build_runs(records, [("full", None), ("snapkv", 64), ("tova", 64)])
    ax = _Axes()
    _series(ax, runs, "kl", ["snapkv", "tova"])
    (x1, y1, k1), (x2, y2, k2) = ax.calls
    assert y1 == y2 and x1 != x2  # same values, side by side
    assert k1["marker"] != k2["marker"] and k1["linestyle"] != k2["linestyle"]
    assert k1["label"] == "snapkv (n=3)"
    assert plot_scores(tmp_path, runs) == ["score_vs_budget.png"]
    assert (tmp_path / "score_vs_budget.png").stat().st_size > 1000
