"""``megatron-rocm apply``: upstream ref -> fork branch with one commit per patch, atomically.

Order of effects, so that a failure or a kill leaves everything as it was:
1. a fresh destination is cloned into a temporary sibling folder (renamed into place last);
2. the whole series is applied in memory (``engine.plan``); any failing hunk stops here;
3. commits are written as unreachable objects (``engine.write_commits``);
4. only then the branch ref is created and checked out;
5. the report is printed last, once the fork is where it says, so a closed pipe (``| head``)
   can never undo a finished apply.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from megatron_rocm.errors import EXIT_OK, PatchFailed, SourceError, UsageError
from megatron_rocm.output import first_failure, hunk_summary, print_json
from megatron_rocm.patchtool import engine, gitcmd, upstream
from megatron_rocm.patchtool.lock import repo_lock
from megatron_rocm.patchtool.results import HunkLabel, PatchResult
from megatron_rocm.patchtool.series import Series, load_series


@dataclass
class Request:
    """What to apply, independent of where the tree comes from."""

    series: Series
    branch: str | None
    three_way: bool
    version_override: str | None
    as_json: bool
    dest: Path  # where the user will find the tree (a fresh clone is moved there last)


@dataclass
class Applied:
    """A finished apply, reported only once the fork is in place."""

    ref: str
    plan: engine.Plan
    branch: str
    tip: str
    already: bool
    commits: dict[str, str]


def branch_name(ref: str, commit: str) -> str:
    name = commit[:12] if re.fullmatch(r"[0-9a-f]{7,40}", ref) else ref
    return "rocm/" + re.sub(r"[^A-Za-z0-9._/-]+", "-", name)


def _is_repo_root(path: Path) -> bool:
    return gitcmd.is_git_repo(path) and gitcmd.git_dir(path).parent == path.resolve()


def _resolve(repo: Path, ref: str, source: upstream.Source | None) -> str:
    try:
        return engine.resolve_commit(repo, ref)
    except UsageError:
        if source is None:
            raise
    # An existing destination that lacks the ref: fetch it into FETCH_HEAD only (no refs move).
    gitcmd.git("fetch", "--no-tags", "-q", source.location, ref, cwd=repo)
    return gitcmd.git_text("rev-parse", "FETCH_HEAD", cwd=repo)


def _accepts(label: HunkLabel, three_way: bool) -> bool:
    return (
        label.applies
        or label is HunkLabel.ALREADY_APPLIED
        or (three_way and label is HunkLabel.NEEDS_3WAY)
    )


def _failing(patches: list[PatchResult], three_way: bool) -> list[PatchResult]:
    return [p for p in patches if p.error or not all(_accepts(h.label, three_way) for h in p.hunks)]


def _failure(bad: list[PatchResult], three_way: bool) -> PatchFailed:
    """One line naming the first failing patch, file, hunk and upstream lines."""
    merge_would_do = not any(p.error for p in bad) and all(
        _accepts(h.label, True) for p in bad for h in p.hunks
    )
    hint = " (retry with --3way)" if merge_would_do and not three_way else ""
    more = f" ({len(bad)} patches fail)" if len(bad) > 1 else ""
    return PatchFailed(f"{first_failure(bad[0])}; nothing was changed{hint}{more}")


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
    dest_path = Path(dest or "Megatron-LM").expanduser().resolve()
    req = Request(load_series(series_dir), branch, three_way, version_override, as_json, dest_path)
    if dest_path.exists() and not dest_path.is_dir():
        raise UsageError(f"destination {dest_path} exists and is not a folder")
    if not dest_path.exists() or not any(dest_path.iterdir()):
        return _apply_fresh(req, upstream.classify(source), ref)
    if not _is_repo_root(dest_path):
        raise UsageError(
            f"destination {dest_path} exists and is not a git clone of Megatron-LM; "
            "choose another --dest"
        )
    src = upstream.classify(source) if source else None
    with repo_lock(gitcmd.git_dir(dest_path)):
        if gitcmd.git_text("status", "--porcelain", "--untracked-files=no", cwd=dest_path):
            raise UsageError(
                f"{dest_path} has uncommitted changes; commit or stash them first (apply never "
                "overwrites your edits)"
            )
        done = _apply_in(dest_path, ref or upstream.default_ref(dest_path), src, req)
    return _show(done, req)


def _apply_fresh(req: Request, src: upstream.Source, ref: str | None) -> int:
    """Clone next to the destination, apply there, and move the result into place last."""
    parent = req.dest.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{req.dest.name}.apply-", dir=parent))
    except PermissionError:
        raise SourceError(f"permission denied: cannot create {req.dest}") from None
    try:
        if src.kind == "pypi":  # resolved first: the cached sdist repo may hold newer tags
            ref = upstream.pypi_ref(ref, quiet=req.as_json)
        repo = upstream.clone_into(src, work / "tree", ref, quiet=req.as_json)
        if ref is None:
            ref = upstream.default_ref(repo)
        done = _apply_in(repo, ref, None, req)
        if req.dest.exists():
            req.dest.rmdir()  # an empty folder the user made for us
        repo.replace(req.dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return _show(done, req)


def _apply_in(repo: Path, ref: str, src: upstream.Source | None, req: Request) -> Applied:
    commit = _resolve(repo, ref, src)
    with gitcmd.CatFile(repo) as cat:
        plan = engine.plan(repo, cat, commit, req.series, req.version_override, req.three_way)
    plan.report.ref = ref
    bad = _failing(plan.report.patches, req.three_way)
    if bad:
        if req.as_json:
            print_json({"ok": False, "dest": str(req.dest), "report": plan.report.to_dict()})
        raise _failure(bad, req.three_way)
    name = req.branch or branch_name(ref, commit)
    made = engine.write_commits(plan)
    tip = made[-1][1] if made else commit
    already = _move_branch(repo, name, tip)
    return Applied(ref, plan, name, tip, already, {pp.patch.id: sha for pp, sha in made})


def _show(done: Applied, req: Request) -> int:
    report = done.plan.report
    if req.as_json:
        print_json(
            {
                "ok": True,
                "already_applied": done.already,
                "dest": str(req.dest),
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
        return EXIT_OK
    print(f"{done.ref} ({done.plan.commit[:12]}, megatron-core {report.version})")
    for p in report.patches:
        if p.variant == "skip":
            state = "skipped"
        elif done.already:
            state = "already applied"
        elif done.commits.get(p.patch_id):
            state = "applied"
        elif p.label is HunkLabel.OUT_OF_SCOPE:
            state = "not in source"  # every file it touches is outside the sdist
        else:
            state = "in upstream"
        print(f"  {state:<16} {p.patch_id:<22} {p.variant or '-':<14} {hunk_summary(p)}")
    if done.already:
        print(f"already applied: {done.branch} at {done.tip[:12]} in {req.dest}; nothing changed")
    else:
        made = len(done.commits)
        print(f"created branch {done.branch} ({made} commits on {done.ref}) in {req.dest}")
    return EXIT_OK


def _move_branch(repo: Path, name: str, tip: str) -> bool:
    """Create ``name`` at ``tip`` and check it out; True when it already was exactly that.

    Commits are deterministic, so an identical branch means this series was applied before;
    a branch with other commits is the user's work and is never moved.
    """
    existing = gitcmd.rev_parse(repo, f"refs/heads/{name}")
    if existing == tip:
        return True
    if existing:
        raise UsageError(
            f"branch {name} already exists at {existing[:12]} with other commits (your edits?); "
            "run `megatron-rocm export` there, or pass --branch NAME"
        )
    gitcmd.git("update-ref", f"refs/heads/{name}", tip, gitcmd.ZERO_OID, cwd=repo)
    try:
        gitcmd.git("checkout", "-q", name, cwd=repo)
    except gitcmd.GitError as e:
        gitcmd.git("update-ref", "-d", f"refs/heads/{name}", tip, cwd=repo)
        raise UsageError(f"cannot check out {name}: {e}; nothing was changed") from None
    return False
