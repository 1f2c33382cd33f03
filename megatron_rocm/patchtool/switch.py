"""Moving an existing fork onto the new branch: the part of apply after its commit point.

Why not ``git checkout``: a checkout killed half way leaves ``.git/index.lock`` and a work
tree that is neither branch, with nothing recording what it was doing. Here:

1. ``check`` (before the commit point) runs the same two-tree merge as a dry run, so a file
   that would be overwritten stops the apply with nothing changed;
2. the journal (``.git/megatron-rocm-apply.json``) is written atomically: the commit point;
3. ``finish`` creates the branch ref, updates the work tree through a *private* index (a copy
   of the real one), swaps that index in with one rename and points HEAD at the branch;
4. the journal is removed.

A run killed after 2 leaves the journal; the next run on the fork calls ``recover``, which
finishes the switch, but only after checking that every path that differs is the old or the
new version, or one git was writing when it died (so an edit made since is never
overwritten). Paths are compared as git stores them (a symlink by its target, a gitlink as
a folder), never by following a link; finishing writes every path from the objects (an
index without stat data), so the fork ends exactly at the new commit. A step of 3 that *fails*
before HEAD moves (a file the work tree cannot take: a read-only folder, a full disk) is
undone instead (``roll_back``), under the same check, so a failed apply changes nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron_rocm.errors import Busy, FatalError, UsageError
from megatron_rocm.patchtool import gitcmd, interrupts

JOURNAL = "megatron-rocm-apply.json"
PRIVATE_INDEX = "megatron-rocm.index"


@dataclass
class Journal:
    pid: int
    branch: str  # short name
    tip: str
    old: str | None  # HEAD's commit before the switch (None: unborn)
    create: bool  # the branch ref did not exist

    @property
    def ref(self) -> str:
        return f"refs/heads/{self.branch}"


def _empty_tree(repo: Path) -> str:
    return gitcmd.git_text("hash-object", "-t", "tree", "--stdin", cwd=repo, input=b"")


def drop_private_index(gdir: Path) -> None:
    """Remove the private index and its lock (a dry run's, or a dead run's)."""
    for name in (PRIVATE_INDEX, PRIVATE_INDEX + ".lock"):
        (gdir / name).unlink(missing_ok=True)


def _private_index(repo: Path, gdir: Path) -> dict[str, str]:
    """A copy of the real index (its stat data spares re-hashing unchanged files), refreshed
    as ``git checkout`` would: a fork copied or restored from a backup has stale stat data."""
    private = gdir / PRIVATE_INDEX
    drop_private_index(gdir)
    real = gitcmd.git_path(repo, "index")
    env = {"GIT_INDEX_FILE": str(private)}
    if real.exists():
        shutil.copyfile(real, private)
        gitcmd.git("update-index", "-q", "--refresh", cwd=repo, env=env, check=False)
    return env


def _statless_index(repo: Path, gdir: Path, commit: str | None) -> dict[str, str]:
    """A private index of ``commit`` with no stat data, for recovery and roll-back: every
    path is then written from the objects. A copy of the real index would trust its stat
    data, and a file a killed or failed switch rewrote in the same second at the same size
    (git's timestamps are whole seconds) would look unchanged and keep the wrong version."""
    drop_private_index(gdir)
    env = {"GIT_INDEX_FILE": str(gdir / PRIVATE_INDEX)}
    gitcmd.git("read-tree", "--end-of-options", commit or _empty_tree(repo), cwd=repo, env=env)
    return env


def refuse_orphaning(repo: Path) -> None:
    """Refuse, changing nothing, when HEAD is detached at a commit that no branch, tag or
    remote ref holds: switching away would leave commits made there reachable only from the
    reflog (``git checkout`` would at least warn; apply never drops a user's work)."""
    if gitcmd.symbolic_head(repo) is not None:
        return
    head = gitcmd.rev_parse(repo, "HEAD")
    if head is None:
        return
    held = gitcmd.git_text(
        "for-each-ref", "--count=1", "--contains", head, "--format=%(refname)", cwd=repo
    )
    if not held:
        raise UsageError(
            f"HEAD in {repo} is detached at {head[:12]}, which no branch or tag holds; "
            "keep that work on a branch first (git branch NAME), then run again (nothing was "
            "changed)"
        )


def refuse_index_locked(repo: Path) -> None:
    """Another git process holds the index (a ``git commit`` waiting in its editor, ...): it
    would put its index back over the switched one, so wait as ``git checkout`` would."""
    lock = gitcmd.index_locked(repo)
    if lock is not None:
        raise Busy(
            f"another git process holds {lock}; let it finish (or remove the file if no git "
            "is running), then run again"
        )


def check(repo: Path, gdir: Path, old: str | None, tip: str, branch: str) -> None:
    """Refuse, changing nothing, when switching the work tree would overwrite a file or
    another git process holds the index."""
    refuse_index_locked(repo)
    _refuse_overwriting_ignored(repo, old, tip, branch)
    try:
        env = _private_index(repo, gdir)  # inside: an interrupt while it is copied drops it too
        gitcmd.git(
            "read-tree",
            "-m",
            "-u",
            "-n",
            "--end-of-options",
            old or _empty_tree(repo),
            tip,
            cwd=repo,
            env=env,
        )
    except gitcmd.GitError as e:
        raise UsageError(
            f"{repo}: switching to {branch} would overwrite work: {e.reason}; move that file "
            "away or commit it, then run again (nothing was changed)"
        ) from None
    finally:
        drop_private_index(gdir)


def _refuse_overwriting_ignored(repo: Path, old: str | None, tip: str, branch: str) -> None:
    """``read-tree -m -u`` refuses to overwrite an untracked file, but takes an ignored one
    (``.gitignore``, ``.git/info/exclude``) as expendable, as ``git checkout`` does. A user's
    ignored file (a local config, notes) is their work too: refuse any file the switch would
    create where one already is."""
    added = gitcmd.git(
        "diff",
        "--name-only",
        "-z",
        "--no-renames",
        "--diff-filter=A",
        "--end-of-options",
        old or _empty_tree(repo),
        tip,
        cwd=repo,
    )
    tracked = _tracked_with_folders(repo)
    for path in added.decode("utf-8", errors="surrogateescape").split("\0"):
        if path in tracked:  # a tracked folder the switch replaces by a file or a symlink
            continue
        if path and ((repo / path).exists() or (repo / path).is_symlink()):
            raise UsageError(
                f"{repo}: switching to {branch} would overwrite {path}, a file git does not "
                "track here; move it away, then run again (nothing was changed)"
            )


def _tracked_with_folders(repo: Path) -> set[str]:
    """The index's paths and every folder above them (the index is clean: checked before)."""
    listed = gitcmd.git("ls-files", "-z", cwd=repo).decode("utf-8", errors="surrogateescape")
    out: set[str] = set()
    for path in listed.split("\0"):
        while path and path not in out:
            out.add(path)
            path = path.rpartition("/")[0]
    return out


def write_journal(gdir: Path, j: Journal) -> None:
    """Write the journal with one rename: after it, the apply is committed."""
    tmp = gdir / (JOURNAL + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(asdict(j), f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, gdir / JOURNAL)


def read_journal(gdir: Path) -> Journal | None:
    path = gdir / JOURNAL
    (gdir / (JOURNAL + ".tmp")).unlink(missing_ok=True)  # never renamed: not committed
    if not path.exists():
        return None
    try:
        return Journal(**json.loads(path.read_text(encoding="utf-8")))
    except (ValueError, TypeError) as e:
        raise UsageError(f"{path} is unreadable ({e}); remove it and check the fork") from None


def finish(repo: Path, gdir: Path, j: Journal, recovering: bool = False) -> None:
    """Ref, work tree, index, HEAD, journal: in that order, each step idempotent."""
    current = gitcmd.rev_parse(repo, j.ref)
    if current is None:
        gitcmd.git(
            "update-ref",
            "-m",
            "megatron-rocm apply",
            "--end-of-options",
            j.ref,
            j.tip,
            gitcmd.ZERO_OID,
            cwd=repo,
        )
    elif current != j.tip:
        raise UsageError(
            f"branch {j.branch} moved to {current[:12]} since an interrupted apply; "
            f"remove {gdir / JOURNAL} once you have checked the fork"
        )
    interrupts.step("ref-moved")
    refuse_index_locked(repo)
    if recovering:
        _verify_only_ours(repo, j)
        env = _statless_index(repo, gdir, j.old)
        gitcmd.git("read-tree", "--reset", "-u", "--end-of-options", j.tip, cwd=repo, env=env)
    else:
        env = _private_index(repo, gdir)
        old = j.old or _empty_tree(repo)
        gitcmd.git("read-tree", "-m", "-u", "--end-of-options", old, j.tip, cwd=repo, env=env)
    interrupts.step("tree-updated")
    os.replace(gdir / PRIVATE_INDEX, gitcmd.git_path(repo, "index"))
    interrupts.step("index-swapped")
    gitcmd.git(
        "symbolic-ref",
        "-m",
        f"megatron-rocm apply: checkout {j.branch}",
        "--end-of-options",
        "HEAD",
        j.ref,
        cwd=repo,
    )
    interrupts.step("head-moved")
    (gdir / JOURNAL).unlink(missing_ok=True)


def roll_back(repo: Path, gdir: Path, j: Journal) -> bool:
    """Undo a switch that failed before it moved HEAD (a file it could not write, ...), so a
    failed apply leaves the fork as it was: the work tree back at the old commit, the files
    the switch added removed, the branch it made deleted, the journal dropped.

    Only where every changed file is the old or the new version (``_verify_only_ours``);
    otherwise, or if undoing fails too, nothing more is touched, False comes back and the
    journal lets the next run finish the switch instead.
    """
    if j.old is None or gitcmd.rev_parse(repo, "HEAD") != j.old:
        return False
    if gitcmd.symbolic_head(repo) == j.ref:
        return False  # HEAD moved: the switch is done but for its journal
    if gitcmd.index_locked(repo) is not None:
        return False  # another git holds the index: leave it be, finish on the next run
    try:
        _verify_only_ours(repo, j)
        env = _statless_index(repo, gdir, j.tip)
        gitcmd.git("read-tree", "--reset", "-u", "--end-of-options", j.old, cwd=repo, env=env)
        _remove_added(repo, j)
        os.replace(gdir / PRIVATE_INDEX, gitcmd.git_path(repo, "index"))
        if j.create and gitcmd.rev_parse(repo, j.ref) == j.tip:
            gitcmd.git("update-ref", "-d", j.ref, j.tip, cwd=repo)
    except (FatalError, OSError):
        return False
    (gdir / JOURNAL).unlink(missing_ok=True)
    return True


def _remove_added(repo: Path, j: Journal) -> None:
    """The files the new commit adds, and the folders that held only them: ``check`` made
    sure none existed before the switch, and ``_verify_only_ours`` that each is the new
    version, so every one present was written by the switch."""
    added = gitcmd.git(
        "diff", "--name-only", "-z", "--no-renames", "--diff-filter=A", "--end-of-options",
        j.old or _empty_tree(repo), j.tip, cwd=repo,
    )  # fmt: skip
    for path in added.decode("utf-8", errors="surrogateescape").split("\0"):
        target = repo / path
        if not path:
            continue
        if target.is_symlink() or target.is_file():
            target.unlink()
        elif target.is_dir() and not any(target.iterdir()):
            target.rmdir()  # a submodule's gitlink, checked out as an empty folder
        else:
            continue
        folder = target.parent
        while folder != repo and not any(folder.iterdir()):
            folder.rmdir()
            folder = folder.parent


@dataclass(frozen=True)
class Entry:
    """What a path is, in a commit or on disk, in the terms the comparison needs."""

    kind: str  # file | link | dir (a tree or a gitlink: a folder on disk) | none
    oid: str = ""  # the blob id of a file's content or a link's target; "" otherwise


NONE = Entry("none")


def _entries(repo: Path, commit: str | None, paths: list[str]) -> dict[str, Entry]:
    """Each of ``paths`` as ``commit`` has it (NONE where it has none)."""
    if commit is None or not paths:
        return {}
    # -r -t: a folder is listed as itself even where a path below it is asked for too
    out = gitcmd.git(
        "ls-tree", "-r", "-t", "-z", "--end-of-options", commit, "--", *paths,
        cwd=repo, env={"GIT_LITERAL_PATHSPECS": "1"},
    )  # fmt: skip
    wanted = set(paths)
    found = {}
    for item in out.decode("utf-8", errors="surrogateescape").split("\0"):
        meta, _, path = item.partition("\t")
        if path in wanted:
            mode, _, oid = meta.split()
            if mode == "120000":
                found[path] = Entry("link", oid)
            elif mode.startswith("100"):
                found[path] = Entry("file", oid)
            else:  # 040000 tree, 160000 gitlink: a folder in the work tree
                found[path] = Entry("dir")
    return found


def _on_disk(repo: Path, paths: list[str]) -> dict[str, Entry]:
    """Each of ``paths`` as the work tree has it, without following symlinks: a symlink is
    its target's text (as git stores it), a folder is only a folder (a gitlink's checkout is
    an empty one; a tracked folder's files are compared one by one), a regular file is hashed
    as ``git add`` would."""
    found: dict[str, Entry] = {}
    regular: list[str] = []
    fmt = gitcmd.git_text("rev-parse", "--show-object-format", cwd=repo) or "sha1"
    for path in paths:
        full = repo / path
        try:
            st = full.lstat()
        except (FileNotFoundError, NotADirectoryError):
            found[path] = NONE
            continue
        if stat.S_ISLNK(st.st_mode):
            target = os.fsencode(os.readlink(full))
            blob = hashlib.new(fmt, b"blob %d\0" % len(target) + target).hexdigest()
            found[path] = Entry("link", blob)
        elif stat.S_ISDIR(st.st_mode):
            found[path] = Entry("dir")
        elif stat.S_ISREG(st.st_mode):
            regular.append(path)
        else:  # a fifo or socket: no version git could have written
            found[path] = Entry("other")
    if regular:
        ids = gitcmd.git_text(
            "hash-object", "--stdin-paths", cwd=repo, input=("\n".join(regular) + "\n").encode()
        ).split()
        found |= {p: Entry("file", oid) for p, oid in zip(regular, ids, strict=True)}
    return found


def _matches(have: Entry, want: Entry) -> bool:
    """The work tree's ``have`` is what a checkout of ``want`` left there, or what it had
    not written yet: git removes a path before it writes its new version, and nothing is
    lost by writing a path that is missing (a folder's files are compared one by one)."""
    return have.kind == "none" or have == want


def _torn(repo: Path, path: str, have: Entry, want: Entry) -> bool:
    """A file git was writing when it was killed: its content so far is a beginning of
    ``want``'s (git writes a file front to back into a new inode, empty first)."""
    if have.kind != "file" or want.kind != "file":
        return False
    blob = gitcmd.git("cat-file", "blob", want.oid, cwd=repo)
    try:
        return blob.startswith((repo / path).read_bytes())
    except OSError:
        return False


class RecoveryBug(RuntimeError):
    """Reading the work tree and our own commits failed: no state of the fork explains it,
    so it is a bug of ours (exit 4), not the source's or the machine's."""


def _verify_only_ours(repo: Path, j: Journal) -> None:
    try:
        _verify(repo, j)
    except gitcmd.GitError as e:
        raise RecoveryBug(f"checking {repo} after an interrupted apply: {e}") from e


def _verify(repo: Path, j: Journal) -> None:
    """Every file that differs from the index must be the old or the new version of a file
    the switch touches; anything else is an edit made since the kill, and stops recovery.

    Any kind of entry is compared as git stores it (symlinks, symlinked folders, gitlinks,
    files that became folders), never by following a link."""
    old = j.old or _empty_tree(repo)
    touched = set(
        gitcmd.git(
            "diff", "--name-only", "-z", "--no-renames", "--end-of-options", old, j.tip, cwd=repo
        )
        .decode("utf-8", errors="surrogateescape")
        .split("\0")
    ) - {""}
    status = gitcmd.git("status", "--porcelain", "-z", "--untracked-files=all", cwd=repo)
    changed = []
    for item in status.decode("utf-8", errors="surrogateescape").split("\0"):
        if len(item) > 3:
            kind, path = item[:2], item[3:]
            if path not in touched:
                if kind != "??":
                    raise UsageError(
                        f"{repo}: {path} was edited after an interrupted apply; commit or "
                        "stash it, then run again to finish that apply"
                    )
                continue
            changed.append(path)
    before = _entries(repo, j.old, changed)
    after = _entries(repo, j.tip, changed)
    have = _on_disk(repo, changed)
    for path in changed:
        sides = [side.get(path, NONE) for side in (before, after)]
        if any(_matches(have[path], want) for want in sides):
            continue
        if not any(_torn(repo, path, have[path], want) for want in sides):
            raise UsageError(
                f"{repo}: {path} differs from both versions an interrupted apply was switching "
                "between (edited since?); save it elsewhere, then run again"
            )
