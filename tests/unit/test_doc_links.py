"""Every relative link in README.md, docs/, benchmarks/ and deploy/ resolves: the file exists, and a ``#anchor``
names a heading of it (GitHub's slugs), so a newcomer's reading path never ends in a 404."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
DIRS = ("docs", "benchmarks", "deploy")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _pages() -> list[Path]:
    return [ROOT / "README.md", *(p for d in DIRS for p in sorted((ROOT / d).rglob("*.md")))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but hyphens dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    body = FENCE.sub("", page.read_text())
    return {slug(m[1]) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*$", body, re.M)}


def _rel(p: Path) -> str:
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    body = FENCE.sub("", page.read_text())
    bad = []
    for target in LINK.findall(body):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, frag = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.is_relative_to(root):  # a clone has only what is inside it
            bad.append(f"{target}: outside the repository")
        elif not dest.exists():
            bad.append(f"{target}: no {_rel(dest)}")
        elif frag and dest.suffix == ".md" and frag not in anchors(dest):
            bad.append(f"{target}: no heading #{frag} in {_rel(dest)}")
    return bad


def test_every_relative_link_in_the_docs_resolves():
    pages = _pages()
    assert ROOT / "docs" / "llm-d.md" in pages
    bad = {str(p.relative_to(ROOT)): b for p in pages if (b := broken_links(p))}
    assert not bad, bad


def test_the_link_check_catches_a_missing_file_and_a_missing_heading(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    (tmp_path / "outside.md").write_text("# Elsewhere\n")
    page = repo / "page.md"
    (repo / "there.md").write_text("# A heading: with `code`\n")
    page.write_text("[ok](there.md#a-heading-with-code) [gone](nothere.md) [bad](there.md#nope) [web](https://x.y)\n"
                    "[out](../outside.md)\n```\n[in a fence](ignored.md)\n```\n")
    assert [b.split(":")[0] for b in broken_links(page, repo)] == ["nothere.md", "there.md#nope", "../outside.md"]
