"""The README's Python and LangChain snippets run as written, from the repo root, on the
embedded model and the bundled samples (the OpenAI snippet needs a running server: the
OpenAI route's tests cover it)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_the_readme_has_its_snippets():
    blocks = python_blocks()
    assert len(blocks) == 3
    assert "RagSnapEngine.load" in blocks[0] and "OpenAI(" in blocks[1]
    assert "ChatRagSnap" in blocks[2] and "cited_answer" in blocks[2]


@pytest.mark.model
@pytest.mark.parametrize("which", [0, 2], ids=["python", "langchain"])
def test_the_snippet_runs_as_written(which):
    code = python_blocks()[which]
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line.rstrip() for line in done.stdout.strip().splitlines()]
    if which == 0:  # the answer, its citations, the verdict, the cache status; the events
        assert re.search(r"\['[^']+'.*\] (True|False|None) (miss|hit)$", lines[0]), lines[0]
        assert lines[1].startswith("meta") and lines[-1] == "done"
        assert lines[-2] == "citations" and lines[2].startswith("token ")
    else:  # the chain keeps the citations; the rag chain cites a sample
        assert "'citations': [{" in done.stdout and "'grounded': " in done.stdout
        assert re.search(r"\['[^']+\.md#\d+'.*\]$", lines[-1]), lines[-1]
