"""`ragsnap eval` input errors: one clear line, exit status 2, before any model loads."""

from __future__ import annotations

import pytest

from ragsnap.cli import main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--format", "niah"], "--format niah needs --haystack"),
        (["--format", "bioasq", "--data", "missing.json"], "--data not found"),
        (["--data", ".", "--press", "nosuch"], "unknown press 'nosuch'"),
        (["--data", ".", "--budget", "0"], "budgets must be positive"),
        (["--data", ".", "--types", "essay"], "unknown --types essay"),
        (["--data", ".", "--limit", "0"], "--limit must be at least 1"),
    ],
)
def test_eval_rejects_bad_input_with_one_line(tmp_path, capsys, argv, message):
    status = main(["eval", "--out", str(tmp_path / "out"), *argv])
    err = capsys.readouterr().err.strip()
    assert status == 2
    assert err.startswith("ragsnap: error:") and message in err
    assert "Traceback" not in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_eval_is_a_subcommand_with_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for option in ("--press", "--budget", "--context-tokens", "--haystack", "--needles", "--limit"):
        assert option in out
