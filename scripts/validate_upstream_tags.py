#!/usr/bin/env python3
"""What CI runs: refresh an upstream mirror, build the matrix, write every report, gate on NEW
breaks.

Why "new": a break that the previous run already reported is known and being worked on;
failing every night for it hides the next one. So the job compares with the previous run's
matrix.json and exits 1 only for (ref, patch) cells that broke since (a new upstream tag
that breaks the series, or main moving). Without a previous run every break counts as new.

    python scripts/validate_upstream_tags.py MIRROR --out reports [--previous old/matrix.json]

MIRROR is a local repository (fetched from its ``origin`` unless --no-fetch) or a git URL
(mirrored into --mirror-dir, then fetched on later runs). Exit codes: 0 no new break,
1 new break, 2 usage, 3 source problem.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from megatron_rocm.commands.matrix import read_watch
from megatron_rocm.error_handler import error_handler
from megatron_rocm.errors import EXIT_FAILED, EXIT_OK, SourceError, UsageError
from megatron_rocm.patchtool import gitcmd
from megatron_rocm.patchtool.matrix import build_matrix, new_breaks, select_refs
from megatron_rocm.patchtool.report import FORMATS, render, write_reports
from megatron_rocm.patchtool.series import load_series

REFSPECS = ("+refs/heads/*:refs/heads/*", "+refs/tags/*:refs/tags/*")


def refresh_mirror(mirror: str, mirror_dir: Path, fetch: bool) -> Path:
    """A local repository holding upstream's tags and branches, freshly fetched."""
    is_url = "://" in mirror or mirror.startswith("git@")
    repo = mirror_dir if is_url else Path(mirror).expanduser()
    if is_url and not (repo / "HEAD").exists() and not (repo / ".git").exists():
        print(f"cloning {mirror} into {repo}", flush=True)
        repo.parent.mkdir(parents=True, exist_ok=True)
        gitcmd.git("clone", "--bare", "--quiet", mirror, str(repo.resolve()), cwd=repo.parent)
        return repo
    if not gitcmd.is_git_repo(repo):
        raise SourceError(f"{repo} is not a git repository (pass a mirror path or a git URL)")
    if not fetch:
        return repo
    remotes = gitcmd.git_text("remote", cwd=repo).split()
    if "origin" not in remotes:
        print(f"note: {repo} has no 'origin' remote; using it as it is", flush=True)
        return repo
    print(f"fetching into {repo}", flush=True)
    gitcmd.git("fetch", "--quiet", "--prune", "--force", "origin", *REFSPECS, cwd=repo)
    return repo


def load_previous(path: str | None) -> dict | None:
    if not path:
        return None
    p = Path(path)
    if not p.is_file():
        print(f"note: no previous run at {p}; every break counts as new", flush=True)
        return None
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except (ValueError, OSError) as e:
        raise UsageError(f"cannot read previous matrix {p}: {e}") from None


def run(args: argparse.Namespace) -> int:
    series = load_series(args.series)
    start = time.perf_counter()
    repo = refresh_mirror(args.mirror, Path(args.mirror_dir), fetch=not args.no_fetch)
    fetched = time.perf_counter()
    refs = select_refs(repo, args.tags, read_watch(args.refs, args.refs_file))
    m = build_matrix(repo, refs, series, source=args.mirror, scan=not args.no_scan)
    out = Path(args.out)
    paths = write_reports(m, list(FORMATS), out)
    current = json.loads((out / FORMATS["json"][1]).read_text(encoding="utf-8"))
    previous = load_previous(args.previous)
    new = new_breaks(current, previous)
    fixed = sorted(
        {
            (r["ref"], p["patch_id"])
            for r in (previous or {}).get("refs", [])
            for p in r.get("patches", [])
            if not p.get("ok", True)
        }
        - {(r["ref"], p["patch_id"]) for r in current["refs"] for p in r["patches"] if not p["ok"]}
    )
    summary_md = os.environ.get("GITHUB_STEP_SUMMARY")
    if summary_md:
        with open(summary_md, "a", encoding="utf-8") as f:
            f.write(render(m, "md"))

    print(f"reports: {', '.join(str(p) for p in paths)}")
    print(
        f"mirror {fetched - start:.1f} s, matrix {m.timings['total_s']:.1f} s ({len(m.rows)} refs)"
    )
    print(m.summary())
    if m.surface is not None:
        for rs in m.surface.refs:
            if rs.new:
                print(
                    f"new CUDA surface at {rs.ref}: {len(rs.new)} uncovered "
                    f"(e.g. {rs.new[0].path}:{rs.new[0].line} {rs.new[0].text[:80]})"
                )
    for ref, patch in fixed:
        print(f"fixed since the previous run: {patch} @ {ref}")
    for row in m.watched_trouble:
        what = row.error or ", ".join(p.patch_id for p in row.report.patches if not p.ok)
        print(f"watched (not gating): {row.name}: {what}")
    for ref, patch in new:
        print(f"NEW BREAK: {patch} @ {ref}")
    if new:
        print(f"{len(new)} new break(s); see {out / FORMATS['html'][1]}")
        return EXIT_FAILED
    print("no new breaks" + ("" if m.ok else " (known breaks remain)"))
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mirror", help="local mirror/clone path, or a git URL")
    parser.add_argument(
        "--mirror-dir",
        default=".mirror/megatron-lm.git",
        help="where a URL is mirrored (default: .mirror/megatron-lm.git)",
    )
    parser.add_argument("--out", default="matrix-report", help="report folder")
    parser.add_argument("--previous", default=None, help="the previous run's matrix.json")
    parser.add_argument(
        "--tags",
        nargs="+",
        default=None,
        metavar="PATTERN",
        help="glob patterns replacing the default set (release tags >= core_v0.12.0, main, "
        "dev and the watched refs)",
    )
    parser.add_argument(
        "--refs",
        nargs="*",
        default=None,
        metavar="PATTERN",
        help="branch/PR refs to watch (default: 'pull-request/*'); reported, never gating",
    )
    parser.add_argument(
        "--refs-file", default=None, metavar="FILE", help="more --refs patterns, one per line"
    )
    parser.add_argument("--series", default=None, help="patch series folder")
    parser.add_argument("--no-scan", action="store_true", help="skip the CUDA-surface scan")
    parser.add_argument("--no-fetch", action="store_true", help="use the mirror as it is")
    args = parser.parse_args(argv)
    with error_handler() as result:
        result.code = run(args)
    return result.code


if __name__ == "__main__":
    sys.exit(main())
