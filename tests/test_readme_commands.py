"""The commands the README and ``docs/`` show stay true to the code.

Every ``ragsnap`` command line in a ``bash`` block parses with the real CLI parser (so a
renamed or removed option fails here), every script and repo file it names exists, and
every ``python -m`` module it runs can be found. Running them all would take hours of
model time; the commands themselves are exercised by the CLI tests.
"""

from __future__ import annotations

import glob
import importlib.util
import re
import shlex
from pathlib import Path

import pytest

from ragsnap.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ASSIGNMENT = re.compile(r"^(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")


def shell_commands(page: Path) -> list[tuple[int, list[str]]]:
    """``(line number, argv)`` of each command in the page's ``bash`` blocks.

    Continuation lines and multi-line quotes are joined, comments dropped, variables assigned earlier in the
    block (or by a ``for`` loop, its first value) expanded, leading ``VAR=value`` prefixes and a trailing ``&`` removed.
    """
    commands: list[tuple[int, list[str]]] = []
    in_block, pending, start, env = False, "", 0, {}
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.startswith("```"):
            in_block, env = line.strip() == "```bash", {}
            continue
        if not in_block:
            continue
        if not pending:
            start = number
        pending += line.rstrip("\\").strip() + " "
        if line.endswith("\\"):
            continue
        try:
            argv = shlex.split(_expand(pending, env), comments=True)
        except ValueError:  # a quoted argument spans lines (a JSON body): read on
            pending += "\n"
            continue
        pending = ""
        if argv[:1] == ["for"] and argv[2:3] == ["in"]:  # check the loop body with the first value
            env[argv[1]] = argv[3].rstrip(";")
        while argv and (match := ASSIGNMENT.match(argv[0])):
            argv.pop(0)
            if not argv:  # a bare assignment: later lines expand it (unquoted, as bash does)
                env[match.group(1)] = match.group(2)
        if argv and argv[-1] == "&":
            argv.pop()
        if argv:
            commands.append((start, argv))
    return commands


def _expand(text: str, env: dict[str, str]) -> str:
    for name, value in env.items():
        text = text.replace(f"${name}", value).replace(f"${{{name}}}", value)
    return text


def _checkable(argv: list[str]) -> bool:
    """ragsnap, scripts and python modules; curl, docker, kubectl need servers or tools CI lacks."""
    program = Path(argv[0]).name
    return program in ("ragsnap", "bash") or (program.startswith("python") and argv[1:2] == ["-m"])


def _cases() -> list[tuple[str, list[str]]]:
    return [
        (f"{page.relative_to(ROOT)}:{number}", argv)
        for page in PAGES
        for number, argv in shell_commands(page)
        if _checkable(argv)
    ]


CASES = _cases()


def test_the_pages_show_commands() -> None:
    ragsnap_lines = [argv for _, argv in CASES if Path(argv[0]).name == "ragsnap"]
    assert len(ragsnap_lines) >= 20  # the extraction itself works


@pytest.mark.parametrize(("where", "argv"), CASES, ids=[where for where, _ in CASES])
def test_command_is_true_to_the_code(where: str, argv: list[str]) -> None:
    program = Path(argv[0]).name
    if program == "ragsnap":
        # the README runs from the repo root: check files it names that live in the repo
        for arg in argv[1:]:
            if arg.startswith(("ragsnap/", "scripts/", "deploy/", "docs/")):
                assert glob.glob(str(ROOT / arg)), f"{where}: {arg} does not exist"
        try:
            build_parser().parse_args(argv[1:])
        except SystemExit as exit_:  # argparse reports the bad option on stderr
            pytest.fail(f"{where}: `{shlex.join(argv)}` does not parse (exit {exit_.code})")
    elif program == "bash":
        assert (ROOT / argv[1]).is_file(), f"{where}: {argv[1]} does not exist"
    else:
        assert importlib.util.find_spec(argv[2]) is not None, f"{where}: no module {argv[2]}"
