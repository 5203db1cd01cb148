"""The README and docs/ pages: every relative link resolves, every repository path they name
exists, the index lists every page, and no issue-tracker numbers leak into user-facing text.

Anchors follow GitHub's heading slugs: the heading's rendered text, lower-cased, characters other
than word characters, spaces and hyphens removed, spaces turned into hyphens, and ``-1``, ``-2``,
... appended to repeats.
"""

from __future__ import annotations

import glob
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]

FENCE = re.compile(r"^```.*?^```[ \t]*$", re.M | re.S)
COMMENT = re.compile(r"<!--.*?-->", re.S)
CODE_SPAN = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
REPO_PATH = re.compile(r"^(coderl|tests|bench|configs|data|docs)/[\w./*-]*$")
RUNTIME = "data/cache"
"""Gitignored, filled at run time (sdists, snapshots, envs, warm starts): a clean clone has none
of it, so the pages may name its folders without them existing."""
ISSUE_REF = re.compile(r"(?<![\w/&#])#\d+\b|\bissues? \d+\b", re.I)


def prose(text: str) -> str:
    """``text`` without fenced code blocks and HTML comments (what a reader sees as prose)."""
    return COMMENT.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's source text (inline code and link markup removed)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, title in HEADING.findall(FENCE.sub("", page.read_text())):
        base = slug(title)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_slug_follows_github() -> None:
    assert slug("Sampling: `bench/generate.py`") == "sampling-benchgeneratepy"
    assert slug("Idle machine, 2026-11-30 08:20 UTC: the targets") == (
        "idle-machine-2026-11-30-0820-utc-the-targets"
    )
    assert slug("Online event ingestion: `bench/online_ingest.py`") == (
        "online-event-ingestion-benchonline_ingestpy"
    )


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            broken.append(f"{target}: no heading with anchor #{anchor}")
    assert not broken, f"{page.name}: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_named_repository_paths_exist(page: Path) -> None:
    spans = CODE_SPAN.findall(prose(page.read_text()))
    missing = [
        s
        for s in spans
        if REPO_PATH.match(s) and not s.startswith(RUNTIME) and not glob.glob(str(ROOT / s))
    ]
    assert not missing, f"{page.name} names paths that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_issue_numbers(page: Path) -> None:
    refs = ISSUE_REF.findall(prose(page.read_text()))
    assert not refs, f"{page.name} mentions issue numbers: {refs}"


def test_index_lists_every_page() -> None:
    index = (DOCS / "index.md").read_text()
    listed = {Path(t.partition("#")[0]).name for t in LINK.findall(index)}
    pages = {p.name for p in DOCS.glob("*.md")} - {"index.md"}
    assert pages <= listed, f"docs/index.md does not list {sorted(pages - listed)}"
    assert "index.md" in {Path(t).name for t in LINK.findall(prose(PAGES[0].read_text()))}
