"""``megatron-rocm apply``: upstream ref -> fork branch with one commit per patch, atomically.

Every value is checked before anything is cloned (bad ref or branch names are exit 2); the
transaction itself (order of effects, commit point, signals, leftovers of killed runs) is
``patchtool.transaction``. The report is printed last, once the fork is where it says.
"""

from __future__ import annotations

import sys
from pathlib import Path

from megatron_rocm.errors import EXIT_OK, Interrupted, SourceError, UsageError
from megatron_rocm.output import hunk_summary, print_json
from megatron_rocm.patchtool import diffio, engine, refnames, transaction, upstream
from megatron_rocm.patchtool.results import HunkLabel
from megatron_rocm.patchtool.series import load_series, parse_version


def _request(
    source: str | None,
    ref: str | None,
    dest: str | None,
    branch: str | None,
    three_way: bool,
    series_dir: str | None,
    version_override: str | None,
    as_json: bool,
) -> transaction.Request:
    """Validate every value (exit 2 before any clone) and build the request."""
    if ref is not None:
        refnames.check_ref(ref)
    if branch is not None:
        refnames.check_branch(branch)
    if version_override is not None:
        parse_version(version_override)
    dest_path = refnames.user_path(
        refnames.check_text(dest, "--dest") if dest is not None else "Megatron-LM", "--dest"
    )
    series = load_series(series_dir)
    diffio.read_all(series)
    fresh = transaction.is_fresh(dest_path)
    src = upstream.classify(source) if (source is not None or fresh) else None
    if src is not None and src.kind == "path" and dest_path.is_relative_to(src.location):
        raise UsageError(
            f"--dest {dest_path} is inside the source {src.location}; choose a folder outside it"
        )
    if src is not None and src.kind == "path" and ref and not ref.startswith(engine.QUALIFIED):
        engine.refuse_ambiguous(Path(src.location), ref)  # before a clone, not after it
    if fresh and src is not None and src.kind == "pypi" and ref is not None:
        upstream.pypi.version_from_ref(ref)  # 'main' has no sdist: say so before any download
    return transaction.Request(
        series, src, ref, dest_path, branch, three_way, version_override, quiet=as_json
    )


def apply(
    *,
    source: str | None,
    ref: str | None,
    dest: str | None,
    branch: str | None,
    three_way: bool,
    series_dir: str | None,
    version_override: str | None,
    as_json: bool,
) -> int:
    req = _request(source, ref, dest, branch, three_way, series_dir, version_override, as_json)
    try:
        done = transaction.run(req)
    except transaction.Failed as e:
        if as_json:
            print_json({"ok": False, "dest": str(req.dest), "report": e.plan.report.to_dict()})
        raise
    try:
        _show(done, req.dest, as_json)
        sys.stdout.flush()  # a full disk or a broken pipe shows here, not after the return
    except BrokenPipeError:
        raise  # the reader went away (`| head`): the error handler keeps apply's own code
    except OSError as e:
        raise SourceError(
            f"cannot print the report ({(e.strerror or str(e)).lower()}); the apply itself "
            f"finished: {done.branch} is checked out in {req.dest}"
        ) from None
    if done.interrupted:
        raise Interrupted(
            done.interrupted,
            f"interrupted after the commit point: the apply finished ({done.branch} is checked "
            f"out in {req.dest})",
        )
    return EXIT_OK


def _show(done: transaction.Outcome, dest: Path, as_json: bool) -> None:
    report = done.plan.report
    already = done.state == "already"
    if as_json:
        print_json(
            {
                "ok": True,
                "already_applied": already,
                "state": done.state,
                "dest": str(dest),
                "branch": done.branch,
                "base": done.plan.commit,
                "tip": done.tip,
                "commits": [
                    {"patch": p.patch_id, "commit": done.commits.get(p.patch_id)}
                    for p in report.patches
                ],
                "report": report.to_dict(),
            }
        )
        return
    print(f"{done.ref} ({done.plan.commit[:12]}, megatron-core {report.version})")
    width = max((len(p.patch_id) for p in report.patches), default=0)
    for p in report.patches:
        if p.variant == "skip":
            state = "skipped"
        elif already:
            state = "already applied"
        elif done.commits.get(p.patch_id):
            state = "applied"
        elif p.label is HunkLabel.OUT_OF_SCOPE:
            state = "not in source"  # every file it touches is outside the sdist
        else:
            state = "in upstream"
        print(f"  {state:<16} {p.patch_id:<{width}} {p.variant or '-':<14} {hunk_summary(p)}")
    if already:
        print(f"already applied: {done.branch} at {done.tip[:12]} in {dest}; nothing changed")
    elif done.state == "switched":
        print(f"checked out {done.branch} (already built, {done.tip[:12]}) in {dest}")
    else:
        made = len(done.commits)
        print(f"created branch {done.branch} ({made} commits on {done.ref}) in {dest}")
