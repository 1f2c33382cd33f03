"""``megatron-rocm apply``: upstream ref -> fork branch with one commit per patch, atomically.

Order of effects, so that a failure or a kill leaves everything as it was:
1. a fresh destination is cloned into a temporary sibling folder (renamed into place last);
2. the whole series is applied in memory (``engine.plan``); any failing hunk stops here;
3. commits are written as unreachable objects (``engine.write_commits``);
4. only then the branch ref is created and checked out.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path

from megatron_rocm import engine, gitcmd, upstream
from megatron_rocm.errors import EXIT_OK, PatchFailed, UsageError
from megatron_rocm.lock import repo_lock
from megatron_rocm.output import first_failure, hunk_summary, print_json
from megatron_rocm.results import HunkLabel
from megatron_rocm.series import load_series


def branch_name(ref: str, commit: str) -> str:
    name = commit[:12] if re.fullmatch(r"[0-9a-f]{7,40}", ref) else ref
    return "rocm/" + re.sub(r"[^A-Za-z0-9._/-]+", "-", name)


def _is_megatron_repo(path: Path) -> bool:
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
    series = load_series(series_dir)
    dest_path = Path(dest or "Megatron-LM").expanduser().resolve()
    if dest_path.exists() and not dest_path.is_dir():
        raise UsageError(f"destination {dest_path} exists and is not a folder")
    fresh = not dest_path.exists() or not any(dest_path.iterdir())
    if not fresh and not _is_megatron_repo(dest_path):
        raise UsageError(
            f"destination {dest_path} exists and is not a git clone of Megatron-LM; "
            "choose another --dest"
        )
    if fresh:
        src = upstream.classify(source)
        parent = dest_path.parent
        parent.mkdir(parents=True, exist_ok=True)
        try:
            work = Path(tempfile.mkdtemp(prefix=f".{dest_path.name}.apply-", dir=parent))
        except PermissionError:
            from megatron_rocm.errors import SourceError

            raise SourceError(f"permission denied: cannot create {dest_path}") from None
        try:
            repo = upstream.clone_into(src, work / "tree", ref, quiet=as_json)
            if ref is None:
                ref = upstream.default_ref(repo)
            elif src.kind == "pypi":
                ref = f"core_v{upstream.pypi.version_from_ref(ref)}"
            code = _apply_in(
                repo,
                ref,
                None,
                branch,
                three_way,
                series,
                version_override,
                as_json,
                fresh=True,
                dest_path=dest_path,
            )
            if dest_path.exists():
                dest_path.rmdir()  # an empty folder the user made for us
            repo.replace(dest_path)
            return code
        finally:
            shutil.rmtree(work, ignore_errors=True)
    src = upstream.classify(source) if source else None
    with repo_lock(gitcmd.git_dir(dest_path)):
        if ref is None:
            ref = upstream.default_ref(dest_path)
        return _apply_in(
            dest_path,
            ref,
            src,
            branch,
            three_way,
            series,
            version_override,
            as_json,
            fresh=False,
            dest_path=dest_path,
        )


def _apply_in(
    repo: Path,
    ref: str,
    src: upstream.Source | None,
    branch: str | None,
    three_way: bool,
    series,
    version_override: str | None,
    as_json: bool,  # noqa: ANN001
    *,
    fresh: bool,
    dest_path: Path,
) -> int:
    if not fresh and gitcmd.git_text("status", "--porcelain", "--untracked-files=no", cwd=repo):
        raise UsageError(
            f"{repo} has uncommitted changes; commit or stash them first (apply never "
            "overwrites your edits)"
        )
    commit = _resolve(repo, ref, src)
    with gitcmd.CatFile(repo) as cat:
        plan = engine.plan(repo, cat, commit, series, version_override, three_way)
    plan.report.ref = ref
    bad = [
        p
        for p in plan.report.patches
        if p.error or not all(_accepts(h.label, three_way) for h in p.hunks)
    ]
    if bad:
        if as_json:
            print_json({"ok": False, "dest": str(dest_path), "report": plan.report.to_dict()})
        hint = (
            " (retry with --3way)"
            if all(
                h.label in (HunkLabel.NEEDS_3WAY,) or _accepts(h.label, False)
                for p in bad
                for h in p.hunks
            )
            and not any(p.error for p in bad)
            else ""
        )
        raise PatchFailed(
            f"{first_failure(bad[0])}; nothing was changed{hint}"
            + (f" ({len(bad)} patches fail)" if len(bad) > 1 else "")
        )
    name = branch or branch_name(ref, commit)
    made = engine.write_commits(plan)
    tip = made[-1][1] if made else commit
    existing = gitcmd.rev_parse(repo, f"refs/heads/{name}")
    already = existing == tip
    if existing and not already:
        raise UsageError(
            f"branch {name} already exists at {existing[:12]} with other commits (your edits?); "
            "run `megatron-rocm export` there, or pass --branch NAME"
        )
    if not already:
        gitcmd.git("update-ref", f"refs/heads/{name}", tip, gitcmd.ZERO_OID, cwd=repo)
        try:
            gitcmd.git("checkout", "-q", name, cwd=repo)
        except gitcmd.GitError as e:
            gitcmd.git("update-ref", "-d", f"refs/heads/{name}", tip, cwd=repo)
            raise UsageError(f"cannot check out {name}: {e}; nothing was changed") from None
    commits = {pp.patch.id: sha for pp, sha in made}
    if as_json:
        print_json(
            {
                "ok": True,
                "already_applied": already,
                "dest": str(dest_path),
                "branch": name,
                "base": commit,
                "tip": tip,
                "commits": [
                    {"patch": p.patch_id, "commit": commits.get(p.patch_id)}
                    for p in plan.report.patches
                ],
                "report": plan.report.to_dict(),
            }
        )
        return EXIT_OK
    print(f"{ref} ({commit[:12]}, megatron-core {plan.report.version})")
    for p in plan.report.patches:
        sha = commits.get(p.patch_id)
        if p.variant == "skip":
            state = "skipped"
        elif p.label is HunkLabel.ALREADY_APPLIED or sha is None:
            state = "already applied" if already else "in upstream"
        else:
            state = "already applied" if already else "applied"
        print(f"  {state:<16} {p.patch_id:<22} {p.variant or '-':<14} {hunk_summary(p)}")
    if already:
        print(f"already applied: {name} at {tip[:12]} in {dest_path}; nothing changed")
    else:
        print(f"created branch {name} ({len(made)} commits on {ref}) in {dest_path}")
    return EXIT_OK
