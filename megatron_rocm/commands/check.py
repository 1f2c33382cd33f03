"""``megatron-rocm check``: apply the series in memory to refs and label every hunk."""

from __future__ import annotations

import argparse
from pathlib import Path

from megatron_rocm.commands import options
from megatron_rocm.errors import EXIT_FAILED, EXIT_OK
from megatron_rocm.output import print_json, print_ref_report
from megatron_rocm.patchtool import diffio, engine, gitcmd, refnames, upstream
from megatron_rocm.patchtool.results import RefReport
from megatron_rocm.patchtool.series import Series, load_series, parse_version


def check_refs(
    repo: Path,
    refs: list[str],
    series: Series,
    version_override: str | None,
    three_way: bool = False,
    where: str | None = None,
) -> list[RefReport]:
    """Plan the series on each ref with one shared ``cat-file`` reader; no checkout."""
    with gitcmd.CatFile(repo) as cat:
        reports = []
        for ref in refs:
            commit = engine.resolve_commit(repo, ref, where)
            engine.refuse_patched(repo, commit, ref)  # every patch would read as upstream's
            report = engine.plan(repo, cat, commit, series, version_override, three_way).report
            report.ref = ref
            reports.append(report)
        return reports


def check(
    *,
    source: str | None,
    refs: list[str] | None,
    series_dir: str | None,
    version_override: str | None,
    as_json: bool,
) -> int:
    for ref in refs or []:  # every value checked before any clone or download
        refnames.check_ref(ref)
    if version_override is not None:
        parse_version(version_override)
    series = load_series(series_dir)
    diffio.read_all(series)
    src = upstream.classify(source)
    if src.kind == "pypi" and refs:
        refs = [f"core_v{upstream.pypi.version_from_ref(r)}" for r in refs]
    repo = upstream.reading_repo(src, refs, quiet=as_json)
    if not refs:
        refs = [upstream.default_ref(repo, where=src.label)]
    reports = check_refs(repo, refs, series, version_override, where=src.label)
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


def add_parser(sub: argparse._SubParsersAction) -> None:
    """This verb's options, on ``main``'s parser."""
    p = sub.add_parser("check", help="check the series against refs without a checkout")
    options.add_source(p)
    p.add_argument("--ref", nargs="+", default=None, help="refs to check (default: newest release)")
    options.add_series(p)
    options.add_json(p)


def run(args: argparse.Namespace) -> int:
    return check(
        source=args.source,
        refs=args.ref,
        series_dir=args.series,
        version_override=args.megatron_version,
        as_json=args.json,
    )
