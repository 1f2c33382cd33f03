"""Put back the tracked ``*.egg-info`` files that ``install``'s build rewrote.

megatron-core sdists ship ``megatron_core.egg-info/``, and ``apply --source pypi`` commits it
with the rest of the sdist. pip's build regenerates that folder from the patched
``pyproject.toml`` (the series adds megatron-rocm to the dependencies), so after ``install``
git saw three modified files, and ``export`` (rightly) refuses a tree with uncommitted
changes: the developer loop broke on the trees ``apply`` made. The installed metadata lives
in site-packages (PEP 660 editable and regular installs alike), so the in-tree copy is a
build by-product; each file the build changed is restored from the index, but only if it
was clean before the build: a user's own edits are never touched.

A tree that is not a git checkout of its own (or has no tracked egg-info), or a machine
without git, needs nothing: install never depended on git and does not start to here.
"""

from __future__ import annotations

import sys
from pathlib import Path

from megatron_rocm.errors import SourceError
from megatron_rocm.patchtool import gitcmd


def _paths(out: bytes) -> set[str]:
    return {p.decode("utf-8", "surrogateescape") for p in out.split(b"\0") if p}


def _is_egg_info(path: str) -> bool:
    return any(part.endswith(".egg-info") for part in path.split("/")[:-1])


def _modified(tree: Path) -> set[str]:
    """Tracked files whose work-tree copy differs from the index."""
    return _paths(gitcmd.git("diff", "--name-only", "-z", cwd=tree))


def clean_tracked_metadata(tree: Path) -> set[str]:
    """Tracked files inside ``*.egg-info`` folders that match the index now (empty if the tree
    is not a git checkout of its own, or git cannot read it)."""
    try:
        if not gitcmd.is_work_tree_root(tree):
            return set()
        listed = gitcmd.git("ls-files", "-z", cwd=tree)
        tracked = {p for p in _paths(listed) if _is_egg_info(p)}
        if not tracked:
            return set()
        return tracked - _modified(tree)
    except (gitcmd.GitError, SourceError):  # no git, or a repository git cannot read
        return set()


def restore_tracked_metadata(tree: Path, clean_before: set[str]) -> list[str]:
    """Restore, from the index, the files of ``clean_before`` that are modified now."""
    if not clean_before:
        return []
    changed = sorted(clean_before & _modified(tree))
    if changed:
        gitcmd.git("checkout-index", "-f", "--", *changed, cwd=tree)
    return changed


def put_back(tree: Path, clean_before: set[str]) -> list[str]:
    """``restore_tracked_metadata`` for ``install``: a git failure here becomes one warning
    line, so it neither fails an install that worked nor hides why one failed."""
    try:
        return restore_tracked_metadata(tree, clean_before)
    except (gitcmd.GitError, SourceError) as e:
        print(
            f"megatron-rocm: warning: could not put back the egg-info files the build "
            f"rewrote in {tree}: {e}",
            file=sys.stderr,
        )
        return []
