"""``megatron-rocm export``: regenerate the series' diffs from a patched fork's commits."""

from __future__ import annotations

import argparse

from megatron_rocm.commands import options
from megatron_rocm.errors import EXIT_OK, UsageError
from megatron_rocm.output import print_json
from megatron_rocm.patchtool import gitcmd, refnames, series_journal
from megatron_rocm.patchtool.export import export_fork
from megatron_rocm.patchtool.series import load_series, parse_version


def export(
    *,
    repo_dir: str,
    new_variant: bool,
    series_dir: str | None,
    version_override: str | None,
    as_json: bool,
) -> int:
    if version_override is not None:
        parse_version(version_override)
    repo = refnames.user_path(refnames.check_text(repo_dir, "--repo"), "--repo")
    if not gitcmd.is_git_repo(repo):
        raise UsageError(f"{repo} is not a git repository (run export inside a patched fork)")
    if gitcmd.toplevel(repo) is None:
        raise UsageError(f"{repo} is a bare repository; run export in the patched fork's checkout")
    folder = load_series(series_dir).folder
    # one writer per series folder, as per fork: two exports that each read `series` and
    # wrote it back would drop one's new line (its folder orphaned); the second refuses (5)
    with series_journal.writer(folder):
        series = load_series(folder)  # as it is now that no other export writes it
        version, items = export_fork(repo, series, version_override, new_variant)
    missing = [i for i in items if i.action == "missing"]
    if as_json:
        print_json(
            {
                "series": str(series.folder),
                "version": str(version),
                "patches": [vars(i) for i in items],
                "ok": True,  # as the exit code says: a patch with no commit is a warning
                "missing": [i.patch_id for i in missing],
            }
        )
    else:
        width = max((len(i.patch_id) for i in items), default=0)
        for i in items:
            print(f"  {i.action:<12} {i.patch_id:<{width}} {i.diff}")
        changed = [i for i in items if i.action not in ("unchanged", "missing", "no-change")]
        print(
            f"exported {len(items) - len(missing)} patches for megatron-core {version} into "
            f"{series.folder}: {len(changed)} changed"
        )
        for i in missing:
            print(f"warning: patch {i.patch_id} has no commit on this fork; left unchanged")
    return EXIT_OK


def add_parser(sub: argparse._SubParsersAction) -> None:
    """This verb's options, on ``main``'s parser."""
    p = sub.add_parser("export", help="turn a patched fork's commits back into diff files")
    p.add_argument("--repo", default=".", help="the patched fork (default: current folder)")
    p.add_argument(
        "--new-variant",
        action="store_true",
        help="for each patch that changed, start a new variant at this tree's version instead "
        "of updating the matching one (unchanged patches keep theirs)",
    )
    options.add_series(p)
    options.add_json(p)


def run(args: argparse.Namespace) -> int:
    return export(
        repo_dir=args.repo,
        new_variant=args.new_variant,
        series_dir=args.series,
        version_override=args.megatron_version,
        as_json=args.json,
    )
