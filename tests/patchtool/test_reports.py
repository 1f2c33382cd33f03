"""The four renderers, on a matrix built from values (no git): every status, a failing hunk,
a droppable patch, and surface findings."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

import pytest
from packaging.version import Version

from megatron_rocm.patchtool import surface
from megatron_rocm.patchtool.matrix import Matrix, RefSpec, Row, new_breaks
from megatron_rocm.patchtool.report import FORMATS, render, slug, write_reports
from megatron_rocm.patchtool.results import HunkLabel, HunkResult, PatchResult, RefReport
from megatron_rocm.patchtool.series import Patch, Series, Variant

HUNK = "@@ -10,3 +10,3 @@\n ctx\n-old <b>&\n+new <script>alert(1)</script>\n ctx\n"


def patch(pid: str, tmp: Path) -> Patch:
    return Patch(
        pid, f"why {pid}", "not-submitted", tmp / pid, [Variant("v0.12.diff", Version("0.12.0"))]
    )


def result(
    pid: str, label: HunkLabel | None, variant: str | None = "v0.12.diff", error: str = ""
) -> PatchResult:
    hunks = (
        []
        if label is None
        else [
            HunkResult(
                "megatron/core/x.py",
                1,
                label,
                10,
                None if label is HunkLabel.CONFLICT else 12,
                "line 11 now reads 'other'" if label is HunkLabel.CONFLICT else "",
                HUNK,
            )
        ]
    )
    return PatchResult(pid, variant, hunks, error)


@pytest.fixture
def m(tmp_path: Path) -> Matrix:
    ids = ["alpha", "beta", "gamma"]
    series = Series(tmp_path, [patch(i, tmp_path) for i in ids])
    rows = [
        Row(
            RefSpec("core_v0.12.0", "a" * 40, "release"),
            RefReport(
                "core_v0.12.0",
                "a" * 40,
                "0.12.0",
                [
                    result("alpha", HunkLabel.CLEAN),
                    result("beta", HunkLabel.OFFSET),
                    result("gamma", None, variant="skip"),
                ],
            ),
        ),
        Row(
            RefSpec("core_v0.13.0", "b" * 40, "release"),
            RefReport(
                "core_v0.13.0",
                "b" * 40,
                "0.13.0",
                [
                    result("alpha", HunkLabel.CONFLICT),
                    result("beta", HunkLabel.FUZZ),
                    result("gamma", HunkLabel.ALREADY_APPLIED),
                ],
            ),
        ),
        Row(
            RefSpec("feature/x", "c" * 40, "branch"),
            RefReport(
                "feature/x",
                "c" * 40,
                "0.14.0",
                [
                    result(
                        "alpha",
                        None,
                        variant=None,
                        error="no variant of alpha covers version 0.14.0",
                    ),
                    result("beta", HunkLabel.NEEDS_3WAY),
                    result("gamma", HunkLabel.FILE_GONE),
                ],
            ),
        ),
    ]
    new = surface.Finding(
        "nccl-option",
        "megatron/training/arguments.py",
        7,
        "group.add_argument('--nccl-ub')",
        "--nccl-ub",
    )
    old = surface.Finding("apex", "megatron/core/clip.py", 3, "import apex", "apex")
    cov = surface.Finding(
        "apex-extension", "megatron/core/x.py", 5, "import amp_C", "amp_C", surface.COVERED, "alpha"
    )
    refs = [
        surface.RefSurface("core_v0.12.0", [old, cov]),
        surface.RefSurface("core_v0.13.0", [old, cov, new], [new], 0, "core_v0.12.0"),
        surface.RefSurface("feature/x", [old, new], [], 1, "core_v0.13.0"),
    ]
    return Matrix(
        "upstream.git",
        series,
        rows,
        surface.SurfaceReport(refs),
        {"check_s": 0.5, "scan_s": 0.25, "total_s": 0.75},
        "2026-01-01T00:00:00Z",
    )


def test_matrix_facts(m):
    assert m.first_break("alpha") == "core_v0.13.0"
    assert m.first_break("beta") == "feature/x"  # fuzz applies; needs-3-way does not
    assert m.droppable("gamma") == ["core_v0.13.0"]
    assert "first breaks: alpha@core_v0.13.0, beta@feature/x, gamma@feature/x" in m.summary()


def test_markdown(m):
    md = render(m, "md")
    assert md.startswith("# megatron-rocm compatibility matrix")
    assert "| ref | version | alpha | beta | gamma |" in md
    assert f"❌ [conflict](#{slug('core_v0.13.0', 'alpha')})" in md
    assert f'<a id="{slug("core_v0.13.0", "alpha")}"></a>' in md
    assert "⚪ skip" in md and "🔵 already-applied" in md
    assert "```diff\n" + HUNK.rstrip("\n") + "\n```" in md
    assert "no variant of alpha covers version 0.14.0" in md
    assert "### New at core_v0.13.0 (since core_v0.12.0): 1" in md
    assert "`megatron/training/arguments.py:7` nccl-option" in md


class Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.hrefs: list[str] = []
        self.external: list[str] = []
        self.stack: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"] or "")
        href = a.get("href") or ""
        if href.startswith("#"):
            self.hrefs.append(href[1:])
        if href.startswith(("http:", "https:", "//")) or a.get("src"):
            self.external.append(href or a.get("src") or "")
        if tag not in ("meta", "br", "img", "input", "link"):
            self.stack.append(tag)

    def handle_endtag(self, tag: str) -> None:
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes <{self.stack[-1:]}>"
        self.stack.pop()


def test_html_is_self_contained_with_working_anchors(m):
    page = render(m, "html")
    parser = Links()
    parser.feed(page)
    assert parser.stack == [], "unclosed tags"
    assert parser.external == []
    assert parser.hrefs and set(parser.hrefs) <= parser.ids
    assert slug("feature/x", "beta") in parser.hrefs  # needs-3-way cell links to its hunk
    assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert 'class="banner bad"' in page and m.summary().split(";")[0] in page
    cells = re.findall(r'<td class="cell (\w+)"', page)
    assert cells == ["ok", "drift", "skip", "fail", "fuzz", "upstream", "fail", "threeway", "fail"]
    assert "1 new at core_v0.13.0" in page


def test_json_round_trip_and_new_breaks(m):
    data = json.loads(render(m, "json"))
    assert data["schema"] == 1 and data["ok"] is False
    assert [r["ref"] for r in data["refs"]] == ["core_v0.12.0", "core_v0.13.0", "feature/x"]
    assert [p["status"] for p in data["refs"][2]["patches"]] == [
        "no-variant",
        "needs-3-way",
        "file-gone",
    ]
    by_id = {p["id"]: p for p in data["patches"]}
    assert by_id["gamma"]["droppable_at"] == ["core_v0.13.0"]
    assert by_id["alpha"]["first_break"] == "core_v0.13.0"
    assert data["surface"]["refs"][1]["new"][0]["symbol"] == "--nccl-ub"
    hunks = data["refs"][0]["patches"][0]["hunks"]
    assert "text" not in hunks[0]  # clean hunks carry no text
    assert new_breaks(data, data) == []
    assert new_breaks(data, None)[0] == ("core_v0.13.0", "alpha")


def test_junit(m):
    root = ET.fromstring(render(m, "junit").encode())
    suites = root.findall("testsuite")
    assert [s.get("name") for s in suites] == [
        "core_v0.12.0",
        "core_v0.13.0",
        "feature/x",
        "cuda-surface",
    ]
    assert root.get("failures") == "4" and root.get("skipped") == "1"
    failure = suites[1].find("testcase[@name='alpha']/failure")
    assert failure is not None and failure.get("type") == "conflict"
    assert "megatron/core/x.py hunk 1" in (failure.get("message") or "")
    assert "<script>" in (failure.text or "")  # escaped in XML, intact after parsing
    assert suites[0].find("testcase[@name='gamma']/skipped") is not None
    assert suites[3].find("testcase[@name='core_v0.13.0']/failure") is None


def test_write_reports_names(m, tmp_path):
    paths = write_reports(m, ["json", "md", "json", "html", "junit"], tmp_path / "out")
    assert [p.name for p in paths] == [
        "matrix.json",
        "matrix.md",
        "matrix.html",
        "matrix.junit.xml",
    ]
    assert set(FORMATS) == {"md", "html", "json", "junit"}
