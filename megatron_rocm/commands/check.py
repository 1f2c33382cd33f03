"""``megatron-rocm check``: apply the series in memory to refs and label every hunk."""

from __future__ import annotations

from pathlib import Path

from megatron_rocm.errors import EXIT_FAILED, EXIT_OK
from megatron_rocm.output import print_json, print_ref_report
from megatron_rocm.patchtool import engine, gitcmd, upstream
from megatron_rocm.patchtool.results import RefReport
from megatron_rocm.patchtool.series import Series, load_series


def check_refs(
    repo: Path,
    refs: list[str],
    series: Series,
    version_override: str | None,
    three_way: bool = False,
) -> list[RefReport]:
    """Plan the series on each ref with one shared ``cat-file`` reader; no checkout."""
    with gitcmd.CatFile(repo) as cat:
        return [
            engine.plan(repo, cat, ref, series, version_override, three_way).report for ref in refs
        ]


def check(
    *,
    source: str | None,
    refs: list[str] | None,
    series_dir: str | None,
    version_override: str | None,
    as_json: bool,
) -> int:
    series = load_series(series_dir)  # fail fast on a broken series, before any clone
    src = upstream.classify(source)
    repo = upstream.reading_repo(src, refs, quiet=as_json)
    if not refs:
        refs = [upstream.default_ref(repo)]
    if src.kind == "pypi":
        refs = [f"core_v{upstream.pypi.version_from_ref(r)}" for r in refs]
    reports = check_refs(repo, refs, series, version_override)
    if as_json:
        print_json(
            {
                "source": src.label,
                "ok": all(r.ok for r in reports),
                "refs": [r.to_dict() for r in reports],
            }
        )
    else:
        for r in reports:
            print_ref_report(r)
        bad = [r.ref for r in reports if not r.ok]
        print(
            f"{len(reports) - len(bad)}/{len(reports)} refs apply"
            + (f"; failing: {', '.join(bad)}" if bad else "")
        )
    return EXIT_OK if all(r.ok for r in reports) else EXIT_FAILED
