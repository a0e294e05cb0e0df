"""The documentation's shape: README.md stays a front page (at most 300 lines), its depth lives in
pages under docs/, and every relative link in README.md, docs/**/*.md and bench/README.md names a
file or directory that exists (relative to the file holding the link; web and mail links and pure
#anchors are not checked, and a #fragment is stripped first)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 300
MIN_DOC_PAGES = 6

# [text](target) or [text](target "title"); an image's ![alt](target) matches too. The target
# runs to the first space or closing parenthesis.
LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+[\"'][^\"']*[\"'])?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")
EXTERNAL = ("http://", "https://", "mailto:")


def markdown_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [f for f in files if f.is_file()]


def relative_links(path: Path) -> list[tuple[int, str]]:
    """``(line number, target)`` of every relative link in ``path`` outside fenced code blocks."""
    links, in_fence = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        for target in LINK.findall(line):
            if target.startswith(EXTERNAL) or target.startswith("#"):
                continue
            links.append((number, target))
    return links


def test_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; keep it to {README_MAX_LINES}"


def test_docs_has_pages():
    pages = sorted((ROOT / "docs").rglob("*.md"))
    assert len(pages) >= MIN_DOC_PAGES, f"docs/ holds {len(pages)} .md pages: {[p.name for p in pages]}"


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path):
    broken = []
    for number, target in relative_links(path):
        local = target.split("#", 1)[0]
        if local and not (path.parent / local).exists():
            broken.append(f"{path.relative_to(ROOT)}:{number}: {target}")
    assert not broken, "links to nothing:\n" + "\n".join(broken)
