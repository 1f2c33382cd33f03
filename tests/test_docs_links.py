"""Every relative link and every path of ours that README.md and docs/ name exists.

A manual whose links or commands lead nowhere fails the reader at the first step. Checked:
markdown links to files (and their ``#anchors``, against the target's headings), and paths
starting with ``megatron_rocm/``, ``scripts/``, ``benchmarks/``, ``patches/`` or ``docs/``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", REPO / "patches" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
PATH = re.compile(
    r"(?<![\w./-])((?:megatron_rocm|scripts|benchmarks|patches|docs)/[\w./<>-]*[\w/])"
)


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    heads = re.findall(r"^#+ (.+)$", path.read_text(encoding="utf-8"), re.M)
    return {anchor(h) for h in heads}


def dead_links(doc: Path) -> list[str]:
    bad = []
    for target in LINK.findall(doc.read_text(encoding="utf-8")):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        file, _, frag = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.exists():
            bad.append(f"{target} (no such file)")
        elif frag and dest.suffix == ".md" and frag not in anchors(dest):
            bad.append(f"{target} (no heading #{frag})")
    return bad


def dead_paths(text: str) -> list[str]:
    bad = []
    for path in PATH.findall(text):
        if "<" in path or "*" in path:  # a pattern (`patches/<id>/...`), not a path
            continue
        if not (REPO / path).exists():
            bad.append(path)
    return bad


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_leads_somewhere(doc: Path) -> None:
    assert not dead_links(doc)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_path_of_ours_exists(doc: Path) -> None:
    assert not dead_paths(doc.read_text(encoding="utf-8"))


def test_the_checks_see_a_dead_link_anchor_and_path(tmp_path: Path) -> None:
    (tmp_path / "b.md").write_text("# Real heading\n")
    doc = tmp_path / "a.md"
    doc.write_text("[x](b.md#real-heading) [y](b.md#gone) [z](missing.md) [w](https://x.org)\n")
    assert dead_links(doc) == ["b.md#gone (no heading #gone)", "missing.md (no such file)"]
    assert dead_paths("run `scripts/nope.py` or `megatron_rocm/main.py`") == ["scripts/nope.py"]
    assert dead_paths("`patches/<id>/patch.toml`") == []
