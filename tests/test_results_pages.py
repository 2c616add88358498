"""RESULTS.md stays a short front page, and the results pages it points to hold together: every image
and relative link in RESULTS.md and docs/results/*.md exists, and every docs/results page is linked
from RESULTS.md (a page nobody links to is a result nobody finds)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "RESULTS.md"
PAGES = sorted((ROOT / "docs" / "results").glob("*.md"))
MAX_LINES = 300
# [text](target) and ![alt](target); the target ends at whitespace or the closing parenthesis
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def relative_targets(path: Path) -> list[str]:
    """The link and image targets of a markdown page that point into the repository."""
    out = []
    for target in LINK.findall(path.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # http(s):, mailto:, in-page anchors
        out.append(target.split("#", 1)[0])
    return out


def missing_targets(path: Path) -> list[str]:
    return [t for t in relative_targets(path) if not (path.parent / t).exists()]


def test_results_md_is_short() -> None:
    lines = len(RESULTS.read_text().splitlines())
    assert lines <= MAX_LINES, f"RESULTS.md has {lines} lines; move detail into docs/results/<topic>.md"


def test_there_are_results_pages() -> None:
    assert len(PAGES) >= 10, [p.name for p in PAGES]


@pytest.mark.parametrize("path", [RESULTS, *PAGES], ids=lambda p: p.name)
def test_links_and_images_exist(path: Path) -> None:
    assert missing_targets(path) == []


def test_every_results_page_is_linked_from_results_md() -> None:
    linked = {(RESULTS.parent / t).resolve() for t in relative_targets(RESULTS)}
    assert [p.name for p in PAGES if p.resolve() not in linked] == []


def test_front_page_figures_are_committed_pngs() -> None:
    images = [t for t in LINK.findall(RESULTS.read_text()) if t.endswith(".png")]
    assert images, "RESULTS.md shows no figure"
    assert all(t.startswith("docs/results/") for t in images), images


def test_the_checks_can_fail(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("![a figure](missing.png) and [a page](gone.md) and [web](https://example.org)\n")
    assert missing_targets(page) == ["missing.png", "gone.md"]
