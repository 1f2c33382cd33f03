"""The one apply transaction: resolve, plan, write objects, move refs, check out.

One owner for the order of effects, with a single commit point:

- fresh destination: everything happens in a scratch clone next to it
  (``.<dest>.apply-<host>-<pid>-*``); the commit point is the rename of that clone onto the
  destination;
- existing fork: objects first (unreachable until a ref names them), then a dry run of the
  work-tree switch; the commit point is the journal (see ``switch``), after which the branch
  ref, the work tree, the index and HEAD move.

SIGINT, SIGTERM or SIGHUP before the commit point unwind it: the fork is exactly as it was
(HEAD, refs, index, work tree) and the scratch clone is gone; after it, the apply completes and
the signal is reported (exit 128 + signal). Leftovers of a SIGKILL (scratch folders, a
journal, a lock that names a dead pid) are found by the next run on that destination, removed
or finished, and reported. ``interrupts.step`` marks each boundary for the fault tests.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path

from megatron_rocm.errors import FatalError, PatchFailed, SourceError, UsageError
from megatron_rocm.patchtool import engine, gitcmd, interrupts, lock, scratch, switch, upstream
from megatron_rocm.patchtool.results import PatchResult, first_failure
from megatron_rocm.patchtool.series import Series
from megatron_rocm.progress import note

FRESH_STEPS = (
    "locked",
    "swept",
    "cloned",
    "resolved",
    "planned",
    "objects-written",
    "branch-ready",
    "committed",
    "finished",
)
EXISTING_STEPS = (
    "locked",
    "recovered",
    "verified",
    "resolved",
    "planned",
    "objects-written",
    "checked",
    "journal-written",
    "ref-moved",
    "tree-updated",
    "index-swapped",
    "head-moved",
    "finished",
)


@dataclass
class Request:
    series: Series
    source: upstream.Source | None  # None: an existing fork without --source
    ref: str | None
    dest: Path
    branch: str | None
    three_way: bool = False
    version_override: str | None = None
    quiet: bool = False


@dataclass
class Outcome:
    ref: str
    plan: engine.Plan
    branch: str
    tip: str
    state: str  # created | switched (branch existed, now checked out) | already
    commits: dict[str, str] = field(default_factory=dict)
    interrupted: int | None = None  # a signal that arrived after the commit point


class Failed(PatchFailed):
    """Patches do not apply; carries the report for ``--json``."""

    def __init__(self, message: str, plan: engine.Plan) -> None:
        super().__init__(message)
        self.plan = plan


def branch_name(ref: str, commit: str) -> str:
    """``rocm/<ref>`` for a tag or branch, by its short name (``refs/heads/main`` and
    ``origin/main`` give ``rocm/main``); a commit id or ``HEAD``, which name no release,
    give ``rocm/<commit[:12]>``."""
    if ref == "HEAD" or re.fullmatch(r"[0-9a-f]{7,40}", ref):
        name = commit[:12]
    else:
        name = re.sub(r"^(refs/(heads|tags)/|refs/remotes/[^/]+/|origin/)", "", ref)
    return "rocm/" + re.sub(r"[^A-Za-z0-9._/-]+", "-", name)


def is_fresh(dest: Path) -> bool:
    return not dest.exists() or (dest.is_dir() and not any(dest.iterdir()))


def run(req: Request) -> Outcome:
    """Apply the series to ``req.dest`` (see the module docstring for the guarantees)."""
    with interrupts.Guard() as guard:
        out = _fresh(req, guard) if is_fresh(req.dest) else None
        if out is None:  # an existing fork (or one that appeared while we waited)
            out = _existing(req, guard)
        interrupts.step("finished")
        out.interrupted = guard.pending if guard.committed else None
    return out


def _failing(patches: list[PatchResult], three_way: bool) -> list[PatchResult]:
    return [p for p in patches if not p.accepted(three_way)]


def _plan(repo: Path, commit: str, ref: str, req: Request) -> engine.Plan:
    with gitcmd.CatFile(repo) as cat:
        plan = engine.plan(repo, cat, commit, req.series, req.version_override, req.three_way)
    plan.report.ref = ref
    bad = _failing(plan.report.patches, req.three_way)
    if bad:
        merge_would_do = all(p.accepted(True) for p in bad)
        hint = " (retry with --3way)" if merge_would_do and not req.three_way else ""
        more = f" ({len(bad)} patches fail)" if len(bad) > 1 else ""
        raise Failed(
            f"{first_failure(bad[0], req.three_way)}; nothing was changed{hint}{more}", plan
        )
    return plan


def _tip(plan: engine.Plan) -> tuple[str, dict[str, str]]:
    made = engine.write_commits(plan)
    return (made[-1][1] if made else plan.commit), {pp.patch.id: sha for pp, sha in made}


def _report_leftovers(found: list[scratch.Leftover], what: str) -> None:
    for item in found:
        note(f"removed {what} of an apply that was killed: {item.describe()}")


def _fresh(req: Request, guard: interrupts.Guard) -> Outcome | None:
    """Clone next to the destination, build the fork there, rename it into place last."""
    assert req.source is not None
    parent, prefix = req.dest.parent, f".{req.dest.name}.apply-"
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        blocker = next((p for p in (parent, *parent.parents) if p.is_file()), None)
        why = f"{blocker} is a file" if blocker else (e.strerror or str(e)).lower()
        raise SourceError(f"cannot create {req.dest}: {why}") from None
    lock_path = parent / f".{req.dest.name}.{lock.LOCK_NAME}"
    with lock.hold(lock_path, what=str(req.dest)) as held:
        if held.previous:
            note(f"a previous apply on {req.dest} (pid {held.previous.split()[0]}) was killed")
        interrupts.step("locked")
        _report_leftovers(scratch.sweep(parent, prefix), "a half-made clone")
        interrupts.step("swept")
        if not is_fresh(req.dest):
            return None
        mode = _adopted_mode(req.dest)
        try:
            work = scratch.make(parent, prefix)
        except OSError as e:
            raise SourceError(
                f"cannot create {req.dest}: {(e.strerror or str(e)).lower()}"
            ) from None
        try:
            return _build_fresh(req, guard, work / "tree", mode)
        finally:
            with guard.deferred():
                shutil.rmtree(work, ignore_errors=True)


def _adopted_mode(dest: Path) -> int | None:
    """The permission bits of the empty folder the user made as the destination, for the new
    fork to take over: the rename replaces that folder, and a 700 or setgid folder must not
    come back as the umask's 755. None where there is no folder yet.

    A folder nobody may write is refused, as ``git clone`` refuses it: filling it would undo
    the user's own read-only mark."""
    try:
        mode = stat.S_IMODE(dest.stat().st_mode)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise SourceError(f"cannot use {dest}: {(e.strerror or str(e)).lower()}") from None
    if not mode & 0o222 or not os.access(dest, os.W_OK | os.X_OK):
        raise SourceError(
            f"cannot create files in {dest}: it is read-only (mode {mode:03o}); nothing was changed"
        )
    return mode


def _sweep_siblings(dest: Path) -> None:
    """What a fresh apply killed on ``dest`` leaves beside it: its scratch and its lock."""
    _report_leftovers(scratch.sweep(dest.parent, f".{dest.name}.apply-"), "a half-made clone")
    holder = lock.clear_stale(dest.parent / f".{dest.name}.{lock.LOCK_NAME}")
    if holder:
        note(f"removed the lock of an apply on {dest} that was killed (pid {holder.split()[0]})")


def _build_fresh(req: Request, guard: interrupts.Guard, repo: Path, mode: int | None) -> Outcome:
    src, ref = req.source, req.ref
    assert src is not None
    if src.kind == "pypi":  # resolved first: the cached sdist repo may hold newer tags
        ref = upstream.pypi_ref(ref, quiet=req.quiet)
    upstream.clone_into(src, repo, ref, quiet=req.quiet)
    interrupts.step("cloned")
    ref = ref or upstream.default_ref(repo, where=src.label)
    commit = engine.find_commit(repo, ref) or upstream.fetch_as_checked(
        repo, src, ref, quiet=req.quiet
    )
    if commit is None:
        raise engine.unknown_ref(ref, src.label)
    engine.refuse_patched(repo, commit, ref)
    interrupts.step("resolved")
    plan = _plan(repo, commit, ref, req)
    interrupts.step("planned")
    tip, commits = _tip(plan)
    interrupts.step("objects-written")
    name = req.branch or branch_name(ref, commit)
    ref_name = f"refs/heads/{name}"
    gitcmd.git(
        "update-ref", "-m", "megatron-rocm apply", "--end-of-options", ref_name, tip, cwd=repo
    )
    gitcmd.git("symbolic-ref", "--end-of-options", "HEAD", ref_name, cwd=repo)
    gitcmd.git("read-tree", "--reset", "-u", "--end-of-options", tip, cwd=repo)
    if mode is not None:
        repo.chmod(mode)
    interrupts.step("branch-ready")
    with guard.deferred():
        try:
            os.replace(repo, req.dest)  # an empty folder the user made is replaced atomically
        except OSError as e:
            raise SourceError(
                f"cannot move the new fork to {req.dest}: {(e.strerror or str(e)).lower()}; nothing was changed"
            ) from None
        guard.commit()
    interrupts.step("committed")
    return Outcome(ref, plan, name, tip, "created", commits)


def _existing(req: Request, guard: interrupts.Guard) -> Outcome:
    repo = req.dest
    if not repo.is_dir():
        raise UsageError(f"destination {repo} exists and is not a folder")
    if not gitcmd.is_work_tree_root(repo):
        raise UsageError(
            f"destination {repo} exists and is not a git clone of Megatron-LM; "
            "choose another --dest"
        )
    if not gitcmd.head_has_folder(repo, "megatron/core"):  # another project's repository
        raise UsageError(
            f"destination {repo} is a git repository but not a clone of Megatron-LM (its HEAD "
            "has no megatron/core); choose another --dest"
        )
    gdir = gitcmd.git_dir(repo)
    with lock.hold(gdir / lock.LOCK_NAME, what=str(repo)) as held:
        if held.previous:
            note(f"a previous apply on {repo} (pid {held.previous.split()[0]}) was killed")
        interrupts.step("locked")
        _sweep_siblings(repo)
        _recover(repo, gdir, guard, held.fd)
        interrupts.step("recovered")
        busy = gitcmd.operation_in_progress(repo)
        if busy is not None:
            raise UsageError(
                f"{repo}: {busy} is in progress; finish or abort it, then run again (apply "
                "switches branches, which would leave it to finish on the wrong one; nothing "
                "was changed)"
            )
        if gitcmd.git_text("status", "--porcelain", "--untracked-files=no", cwd=repo):
            raise UsageError(
                f"{repo} has uncommitted changes; commit or stash them first (apply never "
                "overwrites your edits)"
            )
        switch.refuse_orphaning(repo)
        interrupts.step("verified")
        ref = req.ref or upstream.default_ref(repo)
        commit = engine.find_commit(repo, ref)
        if commit is None and req.source is None:
            raise UsageError(
                f"unknown ref {ref!r} in {repo}; pass --source to fetch it from upstream"
            )
        if commit is None:
            assert req.source is not None
            commit = upstream.fetch_ref(repo, req.source, ref, quiet=req.quiet)
        engine.refuse_patched(repo, commit, ref)
        interrupts.step("resolved")
        plan = _plan(repo, commit, ref, req)
        interrupts.step("planned")
        tip, commits = _tip(plan)
        interrupts.step("objects-written")
        return _switch(req, guard, gdir, held.fd, plan, ref, tip, commits)


def _switch(
    req: Request,
    guard: interrupts.Guard,
    gdir: Path,
    lock_fd: int,
    plan: engine.Plan,
    ref: str,
    tip: str,
    commits: dict[str, str],
) -> Outcome:
    repo = req.dest
    name = req.branch or branch_name(ref, plan.commit)
    existing = gitcmd.rev_parse(repo, f"refs/heads/{name}")
    if existing and existing != tip:
        raise UsageError(
            f"branch {name} already exists at {existing[:12]} with other commits (your edits?); "
            "run `megatron-rocm export` there, or pass --branch NAME"
        )
    on_branch = gitcmd.symbolic_head(repo) == f"refs/heads/{name}"
    if existing and on_branch:
        return Outcome(ref, plan, name, tip, "already", commits)
    elsewhere = gitcmd.worktree_holding(repo, f"refs/heads/{name}") if existing else None
    if elsewhere is not None:
        raise UsageError(
            f"branch {name} is checked out in {elsewhere}; use that worktree, or pass --branch "
            "NAME (nothing was changed)"
        )
    old = gitcmd.rev_parse(repo, "HEAD")
    switch.check(repo, gdir, old, tip, name)
    interrupts.step("checked")
    journal = switch.Journal(os.getpid(), name, tip, old, create=existing is None)
    with gitcmd.shielded(lock_fd):
        with guard.deferred():
            switch.write_journal(gdir, journal)
            guard.commit()
        interrupts.step("journal-written")
        try:
            switch.finish(repo, gdir, journal)
        except FatalError as e:
            if switch.roll_back(repo, gdir, journal):
                raise SourceError(f"{e}; fix that, then run again (nothing was changed)") from None
            raise SourceError(
                f"{e}; the apply is committed: fix that, then run the same command again to "
                "finish it"
            ) from None
    return Outcome(ref, plan, name, tip, "switched" if existing else "created", commits)


def _recover(repo: Path, gdir: Path, guard: interrupts.Guard, lock_fd: int) -> None:
    """Under the lock: finish a committed apply whose process died; drop its scratch."""
    _report_leftovers(scratch.sweep(gdir, scratch.GIT_PREFIX), "scratch files")
    journal = switch.read_journal(gdir)
    if journal is None:
        switch.drop_private_index(gdir)
        return
    note(
        f"finishing an apply of {journal.branch} on {repo} that was stopped after its commit "
        f"point (pid {journal.pid})"
    )
    with gitcmd.shielded(lock_fd), guard.deferred("interrupted after finishing that earlier apply"):
        switch.finish(repo, gdir, journal, recovering=True)
