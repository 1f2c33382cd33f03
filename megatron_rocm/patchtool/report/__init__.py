"""Renderers of the compatibility matrix: Markdown, HTML, JSON and JUnit XML.

Why four: Markdown for PR comments and job summaries, HTML for a person to read at a glance,
JSON for the next run to compare against (new breaks), JUnit for CI test tabs. All render the
same ``matrix.Matrix``; the shared vocabulary (status kinds, symbols, anchors) lives here.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

from megatron_rocm.errors import UsageError
from megatron_rocm.patchtool.matrix import Matrix, Row, status_of
from megatron_rocm.patchtool.results import HunkResult, PatchResult

# format -> (module, default file name)
FORMATS: dict[str, tuple[str, str]] = {
    "md": ("markdown", "matrix.md"),
    "html": ("html", "matrix.html"),
    "json": ("json_report", "matrix.json"),
    "junit": ("junit", "matrix.junit.xml"),
}

# Cell status -> (kind for colour, symbol, meaning). Kinds, best first.
STATUS: dict[str, tuple[str, str, str]] = {
    "clean": ("ok", "✅", "applies at the recorded lines"),
    "offset": ("drift", "🟢", "applies, moved lines (drift)"),
    "fuzz": ("fuzz", "🟡", "applies only with fuzz: refresh the variant"),
    "already-applied": ("upstream", "🔵", "already upstream: the patch can be dropped"),
    "merged": ("upstream", "🔵", "upstream merged the change: the patch can be dropped"),
    "skip": ("skip", "⚪", "not needed for this version"),
    "out-of-scope": ("skip", "⚪", "file not in this source"),
    "needs-3-way": ("threeway", "🟠", "applies only with --3way: new variant needed"),
    "conflict": ("fail", "❌", "does not apply"),
    "file-gone": ("fail", "❌", "the file it edits is gone"),
    "no-variant": ("fail", "❌", "no variant covers this version"),
    "error": ("fail", "❌", "error"),
}


def status_info(status: str) -> tuple[str, str, str]:
    return STATUS.get(status, ("fail", "❌", status))


def verdict(m: Matrix) -> str:
    """The banner text: ``all refs apply`` or what went wrong, breaks first. Refs that could
    not be checked are named apart: they are not the series' failure, but not a pass either."""
    n, parts = len(m.rows), []
    if m.broken_rows:
        parts.append(f"{len(m.broken_rows)} of {n} refs break")
    if m.error_rows:
        parts.append(f"{len(m.error_rows)} of {n} refs could not be checked")
    if m.watched_trouble:
        parts.append(f"{len(m.watched_trouble)} watched pull-request refs fail (not gating)")
    if m.ok:
        parts.insert(0, "all refs apply")
    return ", ".join(parts)


def slug(*parts: str) -> str:
    """An HTML/Markdown anchor from ref and patch names (branch names may hold '/')."""
    return "-".join(re.sub(r"[^A-Za-z0-9_.-]+", "-", p).strip("-") for p in parts)


def short_variant(variant: str | None) -> str:
    return (variant or "").removesuffix(".diff")


def render(m: Matrix, fmt: str) -> str:
    if fmt not in FORMATS:
        raise UsageError(f"unknown report format {fmt!r} (choose from {', '.join(FORMATS)})")
    module = importlib.import_module(f"megatron_rocm.patchtool.report.{FORMATS[fmt][0]}")
    return module.render(m)


def write_reports(m: Matrix, formats: list[str], folder: Path) -> list[Path]:
    """Write each format under its default name in ``folder``; return the paths."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for fmt in dict.fromkeys(formats):
        path = folder / FORMATS[fmt][1]
        path.write_text(render(m, fmt), encoding="utf-8")
        paths.append(path)
    return paths


ATTENTION_KINDS = ("fuzz", "threeway", "fail")  # cells that get a details entry with hunks


def attention_cells(m: Matrix) -> list[tuple[Row, PatchResult]]:
    """(row, patch result) for every cell a maintainer must look at, in matrix order."""
    return [
        (r, p)
        for r in m.rows
        for p in r.report.patches
        if status_info(status_of(p))[0] in ATTENTION_KINDS
    ]


def attention_groups(m: Matrix) -> list[tuple[list[Row], PatchResult]]:
    """Attention cells grouped where a patch fails the same way at several refs.

    Why: a hunk that conflicts from one tag on fails identically at every later tag; showing
    its text once, with the refs listed, keeps the report short. Key: patch, variant, status
    and the failing hunks (path, index, label, text). The first ref's result is shown.
    """
    groups: dict[tuple, tuple[list[Row], PatchResult]] = {}
    for row, p in attention_cells(m):
        key = (
            p.patch_id,
            p.variant,
            status_of(p),
            p.error,
            tuple((h.path, h.index, h.label, h.text) for h in attention_hunks(p)),
        )
        groups.setdefault(key, ([], p))[0].append(row)
    worst_first = {"fail": 0, "threeway": 1, "fuzz": 2}
    return sorted(
        groups.values(), key=lambda g: worst_first.get(status_info(status_of(g[1]))[0], 3)
    )


def ref_list(names: list[str], limit: int = 4) -> str:
    """``a, b, c`` or, for long runs, ``first … last (N refs)``."""
    if len(names) <= limit:
        return ", ".join(names)
    return f"{names[0]} … {names[-1]} ({len(names)} refs)"


def attention_hunks(p: PatchResult) -> list[HunkResult]:
    """The hunks that explain a cell: fuzz, needs-3-way, conflict, file-gone."""
    return [h for h in p.hunks if h.label.value in ("fuzz", "needs-3-way", "conflict", "file-gone")]
