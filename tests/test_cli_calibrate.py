"""The calibrate commands on a tiny random model: held-out items chosen by --skip/--limit,
the result written where --out says (``calibrate`` and ``calibrate-propagation`` share the
item options)."""

from __future__ import annotations

import json

from ragsnap.cli import main


def _items(tmp_path, count: int = 3):
    path = tmp_path / "set.jsonl"
    rows = []
    for i in range(count):
        text = " ".join(f"t{2 + (7 * i + j) % 90}" for j in range(120))
        rows.append(
            {
                "id": f"q{i}",
                "question": f"t{5 + i} t{6 + i}",
                "documents": [{"id": "d", "title": "t3", "text": text}],
                "answers": [f"t{9 + i}"],
            }
        )
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def test_calibrate_propagation_sweeps_the_grid_on_the_held_out_items(tiny, tmp_path, capsys):
    out = tmp_path / "prop.json"
    argv = ["calibrate-propagation", "--data", str(_items(tmp_path)), "--format", "jsonl"]
    argv += ["--skip", "1", "--limit", "2", "--press", "snapkv", "--budget", "40"]
    argv += ["--layers", "1,2", "--shares", "0.5,1.0", "--max-new-tokens", "4", "--out", str(out)]
    assert main(argv) == 0, capsys.readouterr().err
    result = json.loads(out.read_text())
    assert {(p["layer"], p["share"]) for p in result["sweep"]} == {
        (1, 0.5), (1, 1.0), (2, 0.5), (2, 1.0),
    }  # fmt: skip
    assert capsys.readouterr().err.count("calibrated q") == 2  # items 1 and 2


def test_calibrate_writes_a_layer_profile_and_refuses_a_bad_range(tiny, tmp_path, capsys):
    out = tmp_path / "profile.json"
    data = str(_items(tmp_path))
    argv = ["calibrate", "--data", data, "--format", "jsonl", "--limit", "1"]
    assert main([*argv, "--budget", "40", "--max-new-tokens", "4", "--out", str(out)]) == 0
    assert len(json.loads(out.read_text())["items"]) == 1
    assert main(["calibrate", "--data", data, "--limit", "0", "--out", str(out)]) == 2
    assert "--limit" in capsys.readouterr().err


def test_calibrate_is_the_entrance_to_the_other_calibration_tools(capsys):
    import pytest

    # the tool's own parser reads every argument after its name, --help included
    with pytest.raises(SystemExit) as info:
        main(["calibrate", "claim-labels", "--help"])
    assert info.value.code == 0
    assert "usage: ragsnap calibrate claim-labels" in capsys.readouterr().out
    assert main(["calibrate", "claim-labels"]) == 0  # the labelled set, lexical: no model
    report = json.loads(capsys.readouterr().out)
    assert report["n"] == 71 and report["precision"] >= 0.85 and report["recall"] >= 0.85
    # without a tool it calibrates layers, which needs --data and --out
    assert main(["calibrate", "--limit", "1"]) == 2
    assert "--data and --out" in capsys.readouterr().err
