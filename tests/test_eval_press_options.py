"""`ragsnap eval` takes every press option `ragsnap ask` has, checks the data before the
model loads, and records provenance in settings.json (tiny random model, seconds)."""

from __future__ import annotations

import json

import pytest

from ragsnap.cli import build_parser, main
from ragsnap.engine.engine import RagSnapEngine

TUNING = (
    "--window", "--kernel", "--pooling", "--layer-profile", "--keep-instruction", "--lookup",
    "--lookahead",
)  # fmt: skip


def pubmedqa_file(path, count=3):
    decisions = ("yes", "no", "maybe")
    data = {
        f"9{i}": {
            "QUESTION": f"Does treatment {i} reduce pain?",
            "CONTEXTS": [f"Treatment {i} was given to patients. " * 4, "Pain scores fell."],
            "LABELS": ["METHODS", "RESULTS"],
            "final_decision": decisions[i % 3],
            "LONG_ANSWER": "It may.",
        }
        for i in range(count)
    }
    path.write_text(json.dumps(data, indent=2), encoding="utf-8")
    return path


def _option(parser, subcommand, flag):
    sub = next(a for a in parser._actions if a.dest == "command").choices[subcommand]
    return next(a for a in sub._actions if flag in a.option_strings)


def test_ask_and_eval_share_one_definition_of_the_press_options():
    parser = build_parser()
    for flag in TUNING:
        ask, eval_ = _option(parser, "ask", flag), _option(parser, "eval", flag)
        assert (ask.help, ask.type, ask.choices) == (eval_.help, eval_.type, eval_.choices)
    args = parser.parse_args(["eval", "--out", "o", "--ratio", "0.25,0.5", "--kernel", "5"])
    assert args.ratio == [0.25, 0.5] and args.kernel == 5
    with pytest.raises(SystemExit):  # --budget and --ratio exclude each other
        parser.parse_args(["eval", "--out", "o", "--ratio", "0.5", "--budget", "64"])


def _run(tmp_path, *extra):
    data = pubmedqa_file(tmp_path / "pubmedqa.json")
    out = tmp_path / "out"
    argv = ["eval", "--data", str(data), "--out", str(out), "--no-progress", "--no-plots"]
    status = main([*argv, "--max-new-tokens", "3", *extra])
    return status, out


def test_press_options_reach_every_press_and_settings(tiny, tmp_path):
    status, out = _run(
        tmp_path, "--press", "snapkv,streamingllm", "--budget", "24", "--window", "4",
        "--kernel", "3", "--pooling", "avg", "--keep-instruction", "--lookahead", "2",
    )  # fmt: skip
    assert status == 0
    records = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    snap = next(r for r in records if r["press"] == "snapkv")["press_config"]
    stream = next(r for r in records if r["press"] == "streamingllm")["press_config"]
    assert (snap["window"], snap["kernel"], snap["pooling"]) == (4, 3, "avg")
    assert snap["keep_instruction"] and stream["keep_instruction"]
    assert snap["lookahead"] == stream["lookahead"] == 2
    assert stream["window"] == 4 and "kernel" not in stream  # streamingllm has no kernel
    settings = json.loads((out / "settings.json").read_text())
    assert settings["format"] == "pubmedqa"  # guessed
    assert settings["press_options"] == {
        "window": 4, "kernel": 3, "pooling": "avg", "keep_instruction": True, "lookahead": 2,
    }  # fmt: skip
    prov = settings["provenance"]
    assert prov["model"] == "tiny-llama" and prov["threads"] >= 1 and prov["torch"]
    assert prov["dtype"].startswith("torch.") and prov["device"] == "cpu"
    assert prov["matmul_precision"] == "highest"  # a tiny engine built in place
    assert prov["checkout"] is None or len(prov["checkout"]["commit"]) >= 7
    assert len(prov["layer_profile_digest"]) == 16
    assert prov["command"][:2] == ["ragsnap", "eval"] and "--kernel" in prov["command"]
    grid = {(g["press"], g["size"]): g for g in prov["grid"]}
    assert grid[("snapkv", 24)]["kernel"] == 3 and grid[("full", None)]["press"] == "full"


def test_ratio_runs_store_the_share_as_the_size(tiny, tmp_path):
    status, out = _run(tmp_path, "--press", "snapkv", "--ratio", "0.5")
    assert status == 0
    runs = json.loads((out / "metrics.json").read_text())["runs"]
    assert [(r["press"], r["budget"]) for r in runs] == [("full", None), ("snapkv", 0.5)]
    record = json.loads((out / "predictions.jsonl").read_text().splitlines()[1])
    assert record["press_config"]["ratio"] == 0.5 and record["press_config"]["budget"] is None
    assert "- ratios: 0.5" in (out / "report.md").read_text()


def test_changed_press_options_refuse_to_resume_the_folder(tiny, tmp_path):
    assert _run(tmp_path, "--press", "snapkv", "--budget", "40")[0] == 0
    status, _ = _run(tmp_path, "--press", "snapkv", "--budget", "40", "--window", "4")
    assert status == 2  # the stored answers were made with the default window


@pytest.fixture
def no_model(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model must not load")

    monkeypatch.setattr(RagSnapEngine, "from_config", classmethod(refuse))
    monkeypatch.setattr("ragsnap.engine.loading.load_model", refuse)  # eval, calibrate...


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--format", "bioasq"], "does not parse as --format bioasq"),
        (["--format", "hotpotqa"], "does not parse as --format hotpotqa"),
        (["--format", "jsonl"], "does not parse as --format jsonl: first problem"),
        (["--press", "streamingllm", "--kernel", "3"], "--kernel is taken by none of the presses"),
        (["--layer-profile", "missing.json"], "--layer-profile not found"),
        (["--ratio", "1.5"], "ratios must be in (0, 1]"),
    ],
)
def test_wrong_format_or_options_fail_in_one_line_before_the_model(
    no_model, tmp_path, capsys, extra, message
):
    status, out = _run(tmp_path, *extra)
    err = capsys.readouterr().err.strip()
    assert status == 2
    assert err.startswith("ragsnap: error:") and message in err, err
    assert len(err.splitlines()) == 1 and not out.exists()


def test_a_wrongly_guessed_format_says_it_was_guessed(no_model, tmp_path, capsys):
    data = tmp_path / "odd.json"
    data.write_text(json.dumps({"rows": [1, 2]}))
    status = main(["eval", "--data", str(data), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert status == 2 and "format bioasq (guessed; give --format)" in err


def test_checkout_is_recorded_only_for_a_git_work_tree(tmp_path):
    import subprocess
    from pathlib import Path

    import ragsnap
    from ragsnap.eval.provenance import source_checkout

    package = Path(ragsnap.__file__).resolve().parent
    head = subprocess.run(
        ["git", "-C", str(package.parent), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
    )
    if head.returncode == 0:
        assert source_checkout(package)["commit"] == head.stdout.strip()
    (tmp_path / "ragsnap").mkdir()
    assert source_checkout(tmp_path / "ragsnap") is None  # an installed copy: no commit
