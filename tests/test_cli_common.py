"""Options every ``ragsnap`` command shares: --version, --threads, -v anywhere, defaults in help."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from ragsnap.cli import build_parser, main
from ragsnap.cli.progress import configure_threads, default_threads

COMMANDS = [
    ["ask"],
    ["serve"],
    ["eval"],
    ["calibrate"],
    ["diagnose"],
    ["cache", "stats"],
    ["cache", "clear"],
    ["bench", "decode"],
    ["bench", "cache"],
    ["bench", "load"],
]


def help_text(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main([*argv, "--help"])
    assert info.value.code == 0
    return capsys.readouterr().out


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("ragsnap ") and out.split()[1][0].isdigit()


@pytest.mark.parametrize("argv", COMMANDS, ids=" ".join)
def test_every_command_takes_threads_and_verbose_and_shows_defaults(capsys, argv):
    text = help_text(capsys, argv)
    assert "--threads THREADS" in text and "-v, --verbose" in text
    assert "(default:" in text or argv[0] == "bench"


def test_help_shows_the_defaults(capsys):
    text = " ".join(help_text(capsys, ["ask"]).split())
    assert "(default: ragsnap-lookahead;" in text and "(default: 128;" in text
    assert "(default: None)" not in text


def test_verbose_and_threads_work_before_or_after_the_subcommand():
    parser = build_parser()
    before = parser.parse_args(["-v", "--threads", "3", "cache", "stats"])
    after = parser.parse_args(["cache", "stats", "-v", "--threads", "3"])
    neither = parser.parse_args(["cache", "stats"])
    assert before.verbose is True and after.verbose is True
    assert before.threads == after.threads == 3
    assert not hasattr(neither, "verbose") and not hasattr(neither, "threads")


def test_thread_defaults_do_not_oversubscribe(monkeypatch):
    assert [default_threads(n) for n in (1, 2, 3, 4, 16)] == [1, 1, 1, 2, 8]
    previous = torch.get_num_threads()
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # restored after the test
        monkeypatch.setenv(name, "1")
    try:
        assert configure_threads(2) == 2 and torch.get_num_threads() == 2
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        assert configure_threads(None) == 3 and torch.get_num_threads() == 3
        monkeypatch.delenv("OMP_NUM_THREADS")
        assert configure_threads(None) == default_threads()
    finally:
        torch.set_num_threads(previous)


def test_zero_threads_is_one_clear_line(capsys, tmp_path):
    code = main(["cache", "stats", "--threads", "0", "--cache", f"file://{tmp_path}"])
    assert code == 2
    assert capsys.readouterr().err.strip() == "ragsnap: error: --threads must be at least 1, got 0"


@pytest.mark.model
def test_diagnose_runs_with_the_default_presses(engine, capsys, monkeypatch, tmp_path):
    monkeypatch.setattr("ragsnap.engine.loading.load_runtime", lambda config, **k: engine.runtime)
    doc = tmp_path / "essay.txt"
    filler = "The committee met again to discuss the budget of the village library. " * 30
    doc.write_text(filler + "The special magic number for amber-fox is 4815162. " + filler)
    out = tmp_path / "span.png"
    argv = ["diagnose", "-q", "What is the special magic number for amber-fox?", "--docs"]
    code = main([*argv, str(doc), "--answer", "4815162", "--budget", "128", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(captured.out)
    assert [p["press"] for p in report["presses"]] == ["snapkv", "wordspan", "attnmatch", "ragsnap"]
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_a_bad_setting_in_the_environment_is_one_line_naming_it(monkeypatch, capsys, tmp_path):
    """Read when a command runs, not when the parser is built (every command's parser)."""
    monkeypatch.setenv("RAGSNAP_MATMUL_PRECISION", "bogus")
    with pytest.raises(SystemExit) as version:
        main(["--version"])
    assert version.value.code == 0
    capsys.readouterr()
    doc = tmp_path / "tides.md"
    doc.write_text("The Moon's gravity causes the tides.")
    for argv in (["ask", "-q", "Why?", "--docs", str(doc)], ["cache", "stats"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [
            "ragsnap: error: setting matmul_precision: "
            "Input should be 'auto', 'highest' or 'medium'"
        ]


def test_work_in_a_passing_thread_returns_or_raises_there_and_leaves_the_caller_as_it_was():
    import threading

    import torch

    from ragsnap.errors import ConfigError
    from ragsnap.runtime.threads import in_a_passing_thread

    before = torch.get_num_threads()
    seen: list[threading.Thread] = []

    def work() -> int:
        seen.append(threading.current_thread())
        torch.set_num_threads(before + 1)  # this thread's setting, not the caller's
        return 7

    assert in_a_passing_thread(work) == 7
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()
    assert torch.get_num_threads() == before

    def failing() -> int:
        raise ConfigError("no such model", field="model")

    with pytest.raises(ConfigError, match="no such model"):
        in_a_passing_thread(failing)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_a_background_thread_computes_on_one_torch_thread_at_the_lowest_priority():
    import os
    import threading

    from ragsnap.runtime.threads import (
        BACKGROUND_NICE,
        background_torch_thread,
        in_a_passing_thread,
    )

    def work() -> tuple[int, int]:
        background_torch_thread()
        return torch.get_num_threads(), os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    caller = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert in_a_passing_thread(work) == (1, BACKGROUND_NICE)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == caller  # only its own
