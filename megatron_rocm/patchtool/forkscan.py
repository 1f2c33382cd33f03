"""Which commits of a fork are patches: the upstream base, then one commit per patch.

Why this needs care: ``export`` writes the series from these commits, so a commit taken for
upstream, or skipped, is an edit lost. The rules, each refusing (exit 2, naming the commit)
rather than guessing:

- the base is the ``Megatron-ROCm-Base`` trailer ``apply`` writes (when it is still an
  ancestor), else the parent of the oldest commit with a ``Megatron-ROCm-Patch`` trailer;
- a commit without a patch trailer that ``apply`` made (its author is megatron-rocm) lost its
  trailer in an amend: refused, since its edit would otherwise go unexported (one whose
  subject is a patch's reason is ``export``'s to judge: it knows the diffs);
- a user's commit without a trailer below a patch commit is refused (squash it into its
  patch or move it on top); on top of the last patch commit it becomes a new patch;
- merges, and a rebase, merge, cherry-pick, revert or bisect in progress, are refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from megatron_rocm.errors import UsageError
from megatron_rocm.patchtool import engine, gitcmd
from megatron_rocm.patchtool.series import Patch, Series

_TRAILER_RE = re.compile(rf"^{engine.TRAILER}:\s*(\S+)\s*$", re.M)
_BASE_RE = re.compile(rf"^{engine.BASE_TRAILER}:\s*([0-9a-f]{{40,64}})\s*$", re.M)


@dataclass
class ForkCommit:
    commit: str
    parent: str
    patch_id: str | None  # None: a user commit without trailer (a new patch)
    subject: str


def refuse_busy_or_dirty(repo: Path) -> None:
    """Export reads commits: an operation half done or uncommitted edits would be missed."""
    what = gitcmd.operation_in_progress(repo)
    if what is not None:
        raise UsageError(
            f"{repo}: {what} is in progress; finish or abort it, then export "
            "(export reads finished commits only)"
        )
    dirty = gitcmd.git("status", "--porcelain", "-z", "--untracked-files=no", cwd=repo)
    if dirty:
        first = dirty.decode("utf-8", errors="replace").split("\0")[0][3:]
        raise UsageError(
            f"{repo} has uncommitted changes ({first}); amend them into the patch's commit or "
            "commit them, then export (uncommitted edits are not exported)"
        )


def _records(repo: Path, *rev_args: str) -> list[tuple[str, list[str], str, str]]:
    """(commit, parents, author email, message) along first parents, newest first."""
    out = gitcmd.git(
        "log",
        "--first-parent",
        "-z",
        "--format=%H %P%n%ae%n%B",
        "--end-of-options",
        *rev_args,
        cwd=repo,
    )
    records = []
    for record in out.decode("utf-8", errors="surrogateescape").split("\0"):
        if not record.strip():
            continue
        head, _, rest = record.partition("\n")
        email, _, body = rest.partition("\n")
        ids = head.split()
        records.append((ids[0], ids[1:], email.strip(), body))
    return records


def _base(repo: Path) -> str:
    trailer_commits = gitcmd.git_text(
        "rev-list",
        "--first-parent",
        f"--grep=^{engine.TRAILER}:",
        "--end-of-options",
        "HEAD",
        cwd=repo,
    ).split()
    if not trailer_commits:
        raise UsageError(
            f"{repo} is not a megatron-rocm fork: no commit on HEAD carries a "
            f"'{engine.TRAILER}:' trailer (run `megatron-rocm apply` first)"
        )
    oldest = trailer_commits[-1]
    parents = gitcmd.git_text("log", "-1", "--format=%P", "--end-of-options", oldest, cwd=repo)
    parents = parents.split()
    if not parents:
        raise UsageError(f"patch commit {oldest[:12]} has no parent: no upstream base to diff to")
    fallback = parents[0]
    message = gitcmd.git_text("log", "-1", "--format=%B", "--end-of-options", oldest, cwd=repo)
    m = _BASE_RE.search(message)
    if (
        m
        and m.group(1) != fallback
        and gitcmd.git_ok(
            "merge-base", "--is-ancestor", "--end-of-options", m.group(1), fallback, cwd=repo
        )
    ):
        return m.group(1)  # commits between it and the first patch are fork commits too
    return fallback


def patch_with_reason(series: Series, subject: str) -> Patch | None:
    """The patch whose reason is this commit subject (``apply`` writes the reason as the
    subject), if any."""
    norm = " ".join(subject.split())
    return next((p for p in series.patches if " ".join(p.reason.split()) == norm), None)


def _guess(series: Series, subject: str) -> str:
    hit = patch_with_reason(series, subject)
    return f" (it looks like patch {hit.id})" if hit else ""


def fork_commits(repo: Path, series: Series) -> tuple[str, list[ForkCommit]]:
    """(base, patch and new commits oldest first); refuses what export cannot map safely."""
    base = _base(repo)
    identity = gitcmd.IDENTITY["GIT_AUTHOR_EMAIL"]
    records = list(reversed(_records(repo, f"{base}..HEAD")))
    last_patch = max((i for i, r in enumerate(records) if _TRAILER_RE.search(r[3])), default=-1)
    commits = []
    for i, (commit, parents, email, body) in enumerate(records):
        subject = body.strip().splitlines()[0] if body.strip() else ""
        if len(parents) > 1:
            raise UsageError(
                f"merge commit {commit[:12]} in the fork; export needs a linear branch"
            )
        m = _TRAILER_RE.search(body)
        if m is None and email == identity:
            raise UsageError(
                f"commit {commit[:12]} ({subject!r}) was made by megatron-rocm apply but lost "
                f"its '{engine.TRAILER}: <id>' trailer{_guess(series, subject)}; put it back "
                "(git commit --amend), then export"
            )
        if m is None and i < last_patch:
            raise UsageError(
                f"commit {commit[:12]} ({subject!r}) has no '{engine.TRAILER}:' trailer but sits "
                "below a patch commit; squash it into the patch it belongs to (keeping that "
                "trailer) or move it on top to make it a new patch"
            )
        commits.append(ForkCommit(commit, parents[0], m.group(1) if m else None, subject))
    return base, commits
