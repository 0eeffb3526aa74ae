"""The user docs stay short and their links resolve (issue 55: docs/ is for users; the
experiment log lives in lab/).

Every relative link of README.md and docs/*.md names a file of the repository, and a
``#fragment`` a heading of that page (GitHub's anchors); the pages under docs/ total at
most 2,000 lines.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
DOCS_LINES = 2000


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    found, in_code = set(), False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and (match := re.match(r"#{1,6}\s+(.*)", line)):
            slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
            found.add(slug)
    return found


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]  # no http:, mailto:


def test_anchors_follow_github() -> None:
    page = ROOT / "lab" / "results.md"
    assert "ray-serves-added-latency-ragsnap-bench-overhead-issue-12" in anchors(page)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in links(page):
        path, _, fragment = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            broken.append(f"{target}: no such heading")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_the_docs_are_user_docs_of_at_most_2000_lines() -> None:
    lines = {p.name: len(p.read_text(encoding="utf-8").splitlines()) for p in PAGES[1:]}
    assert sum(lines.values()) <= DOCS_LINES, lines
    assert (ROOT / "lab" / "results.md").is_file()  # the experiment log, out of docs/
