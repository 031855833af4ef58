"""The README and the pages under docs/ link only to what exists: files of the repository, pages, and
headings within them (the site build, ``make docs``, checks the API reference on top)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """The anchor GitHub and Python-Markdown give a heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def prose(path: Path) -> str:
    """The text outside fenced code blocks."""
    kept, fence = [], False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence:
            kept.append(line)
    return "\n".join(kept)


def anchors(path: Path) -> set[str]:
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", prose(path), re.M)}


def links() -> list[tuple[Path, str]]:
    return [(doc, target) for doc in DOCUMENTS for target in LINK.findall(prose(doc))
            if not re.match(r"[a-z]+:", target)]


def test_the_documents_are_found():
    names = {p.name for p in DOCUMENTS}
    assert {"README.md", "index.md", "optimizers.md", "distributed.md", "gpu.md", "reliability.md"} <= names


@pytest.mark.parametrize("doc, target", links(), ids=lambda v: v if isinstance(v, str) else v.name)
def test_every_relative_link_resolves(doc, target):
    path, _, anchor = target.partition("#")
    file = (doc.parent / path).resolve() if path else doc
    assert file.exists(), f"{doc.relative_to(ROOT)} links to {target}, which does not exist"
    assert file.is_relative_to(ROOT), f"{doc.relative_to(ROOT)} links outside the repository: {target}"
    if anchor:
        assert file.suffix == ".md" and anchor in anchors(file), (
            f"{doc.relative_to(ROOT)} links to {target}, but {file.name} has no heading with that anchor")


def test_every_page_is_in_the_site_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in (ROOT / "docs").rglob("*.md"):
        assert str(page.relative_to(ROOT / "docs")) in nav, f"docs/{page.name} is not in mkdocs.yml's nav"


def test_the_readme_stays_an_entry_point():
    """What a newcomer needs first, near the top; the reference lives in docs/."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    first_script = text.index("## A first training script")
    assert text.index("## Install") < first_script < text.index("## Which optimizer should I use?")
