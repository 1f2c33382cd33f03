"""The one module through which every git process runs: plumbing, clone and fetch with their
progress, the 3-way merge, and the long-lived ``cat-file`` reader.

Why one layer: exported diffs must be byte-stable on every machine, and no user value may be
read by git as an option or a config. So every process here gets

- a sanitised environment: no ``GIT_*`` variable of the caller (a hook's ``GIT_DIR`` must not
  leak in), user and system config ignored, no prompts, a fixed locale;
- pinned configuration (``PINNED_CONFIG``): no hooks, no fsmonitor, no ``ext::`` transport,
  no auto-gc, no line-ending conversion;
- user values only after ``--end-of-options`` or ``--``, and only once ``refnames`` has
  validated them (callers do that at the CLI boundary, before any clone).

GitPython stays a dependency for one job only: parsing git's progress lines
(``progress.CloneProgress``); the processes themselves are started here.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from megatron_rocm.errors import FatalError, SourceError
from megatron_rocm.patchtool import scratch

# Every diff we write or compare is produced with exactly these options.
DIFF_ARGS: tuple[str, ...] = (
    "diff",
    "--no-color",
    "--no-ext-diff",
    "--full-index",
    "--no-renames",
    "--diff-algorithm=myers",
    "-U3",
    "--src-prefix=a/",
    "--dst-prefix=b/",
    "--no-textconv",  # a fork's diff drivers must not rewrite what the series stores
    "--no-relative",
    f"-O{os.devnull}",  # the default file order, whatever diff.orderFile says
)

PINNED_CONFIG: tuple[tuple[str, str], ...] = (
    ("core.quotepath", "false"),
    ("diff.interHunkContext", "0"),  # the diff settings a fork's config could change
    ("diff.suppressBlankEmpty", "false"),
    ("diff.indentHeuristic", "true"),
    ("core.autocrlf", "false"),
    ("core.safecrlf", "false"),
    ("core.fsmonitor", "false"),
    ("core.hooksPath", os.devnull),
    ("core.splitIndex", "false"),
    ("protocol.ext.allow", "never"),
    ("submodule.recurse", "false"),
    ("fetch.recurseSubmodules", "false"),
    ("gc.auto", "0"),
    ("maintenance.auto", "false"),
)

IDENTITY = {
    "GIT_AUTHOR_NAME": "megatron-rocm",
    "GIT_AUTHOR_EMAIL": "megatron-rocm@users.noreply.github.com",
    "GIT_COMMITTER_NAME": "megatron-rocm",
    "GIT_COMMITTER_EMAIL": "megatron-rocm@users.noreply.github.com",
}

ZERO_OID = "0" * 40
MIN_GIT = (2, 30)  # --end-of-options in rev-parse
# Transport settings of the user's shell that only say how to reach a server.
_KEEP_ENV = ("GIT_SSH", "GIT_SSH_COMMAND", "GIT_SSH_VARIANT", "GIT_SSL_CAINFO", "GIT_SSL_CAPATH")
_checked: set[str] = set()
_shielded: tuple[int, ...] | None = None  # fds the shielded children inherit (the lock)


class GitError(FatalError):
    """A git command failed; the message names the command and git's own words.

    Exit 3: our own plumbing fails only when the repository or the machine is in trouble
    (disk, permissions, a corrupt object store). Callers turn expected failures (an unknown
    ref, a conflict) into their own errors using ``reason``.
    """

    code = 3

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason


def git_binary() -> str:
    path = shutil.which("git")
    if path is None:
        raise SourceError("git is not installed or not on PATH; install git and try again")
    if path not in _checked:
        out = subprocess.run(
            [path, "version"], capture_output=True, env=sanitized_env(), check=False
        ).stdout.decode(errors="replace")
        m = re.search(r"(\d+)\.(\d+)", out)
        if m and (int(m.group(1)), int(m.group(2))) < MIN_GIT:
            raise SourceError(
                f"{out.strip()} is too old; megatron-rocm needs git "
                f"{'.'.join(map(str, MIN_GIT))} or newer"
            )
        _checked.add(path)
    return path


def sanitized_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """os.environ without GIT_* (except transport settings), config files ignored."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_") or k in _KEEP_ENV}
    env.update(
        GIT_CONFIG_NOSYSTEM="1",
        GIT_CONFIG_GLOBAL=os.devnull,
        GIT_TERMINAL_PROMPT="0",
        GIT_OPTIONAL_LOCKS="0",
        LC_ALL="C",
        LANG="C",
    )
    if extra:
        env.update(extra)
    return env


def argv(*args: str) -> list[str]:
    """The full command line: git, the pinned configuration, then ``args``."""
    pinned = [x for key, value in PINNED_CONFIG for x in ("-c", f"{key}={value}")]
    return [git_binary(), *pinned, *args]


@contextlib.contextmanager
def shielded(*keep_fds: int) -> Iterator[None]:
    """Start git in its own process group: a Ctrl-C on the terminal (sent to the foreground
    group) then reaches only us, and we decide (the apply transaction finishes its commit).

    ``keep_fds`` (the destination's lock) are inherited by those children: if we are killed
    while one of them still writes, the lock stays held until it is done too.
    """
    global _shielded
    before = _shielded
    _shielded = (*(before or ()), *keep_fds)
    try:
        yield
    finally:
        _shielded = before


def _spawn_args(env: Mapping[str, str] | None) -> dict[str, Any]:
    kw: dict[str, Any] = {"env": sanitized_env(env)}
    if _shielded is not None:
        kw["process_group"] = 0
        kw["pass_fds"] = _shielded
    return kw


def git(
    *args: str,
    cwd: str | Path,
    input: bytes | None = None,
    env: Mapping[str, str] | None = None,
    check: bool = True,
) -> bytes:
    """Run ``git <args>`` in ``cwd`` and return stdout; raise GitError on failure."""
    try:
        proc = subprocess.run(
            argv(*args), cwd=cwd, input=input, capture_output=True, check=False, **_spawn_args(env)
        )
    except FileNotFoundError as e:
        raise SourceError(f"cannot run git in {cwd}: {e.strerror}") from None
    except PermissionError as e:
        raise SourceError(f"permission denied running git in {cwd}: {e.strerror}") from None
    if check and proc.returncode != 0:
        msg = proc.stderr.decode(errors="replace").strip().splitlines()
        last = msg[-1] if msg else f"exit code {proc.returncode}"
        raise GitError(f"git {' '.join(args[:3])} failed: {last}", reason=last)
    return proc.stdout


def git_text(*args: str, cwd: str | Path, **kw: Any) -> str:
    return git(*args, cwd=cwd, **kw).decode("utf-8", errors="surrogateescape").strip()


def git_ok(*args: str, cwd: str | Path) -> bool:
    try:
        git(*args, cwd=cwd)
    except GitError:
        return False
    return True


def is_git_repo(path: str | Path) -> bool:
    p = Path(path)
    if not p.is_dir():
        return False
    git_binary()  # a missing git is its own error, not "not a repository"
    try:
        out = git_text("rev-parse", "--git-dir", cwd=p)
    except (GitError, SourceError):
        return False
    return bool(out)


def git_dir(repo: str | Path) -> Path:
    return Path(git_text("rev-parse", "--absolute-git-dir", cwd=repo))


def toplevel(repo: str | Path) -> Path | None:
    """The work tree root containing ``repo``, or None for a bare repository.

    Only git's newline is cut (not ``git_text``'s strip): a root may end in a space."""
    try:
        out = git("rev-parse", "--show-toplevel", cwd=repo)
    except GitError:
        return None
    out = out.decode("utf-8", errors="surrogateescape").removesuffix("\n")
    return Path(out) if out else None


def is_work_tree_root(path: str | Path) -> bool:
    """Whether ``path`` is the root of a git work tree (not a folder inside one, not bare)."""
    top = toplevel(path) if is_git_repo(path) else None
    return top is not None and top.resolve() == Path(path).resolve()


def git_path(repo: str | Path, name: str) -> Path:
    """``.git/<name>`` as git resolves it (linked worktrees have their own index, HEAD...)."""
    out = Path(git_text("rev-parse", "--git-path", name, cwd=repo))
    return out if out.is_absolute() else Path(repo) / out


def rev_parse(repo: str | Path, rev: str) -> str | None:
    """Full commit id of ``rev`` or None when it does not name a commit."""
    try:
        return git_text(
            "rev-parse", "--verify", "--quiet", "--end-of-options", f"{rev}^{{commit}}", cwd=repo
        )
    except GitError:
        return None


def head_has_folder(repo: str | Path, folder: str) -> bool:
    """Whether the commit HEAD names has ``folder`` (False on an unborn HEAD)."""
    try:
        kind = git_text("cat-file", "-t", "--end-of-options", f"HEAD:{folder}", cwd=repo)
    except GitError:
        return False
    return kind == "tree"


# Files git keeps while an operation is half done, and what to call it.
IN_PROGRESS = {
    "rebase-merge": "a rebase",
    "rebase-apply": "a rebase or git am",
    "MERGE_HEAD": "a merge",
    "CHERRY_PICK_HEAD": "a cherry-pick",
    "REVERT_HEAD": "a revert",
    "BISECT_LOG": "a bisect",
    "sequencer": "a cherry-pick or revert of several commits",  # CHERRY_PICK_HEAD goes between
}


def operation_in_progress(repo: str | Path) -> str | None:
    """The git operation half done in ``repo`` (``"a rebase"``...), or None."""
    for name, what in IN_PROGRESS.items():
        if git_path(repo, name).exists():
            return what
    return None


def index_locked(repo: str | Path) -> Path | None:
    """``.git/index.lock`` when another git process holds the index (or died holding it)."""
    lock = git_path(repo, "index.lock")
    return lock if lock.exists() or lock.is_symlink() else None


def worktree_holding(repo: str | Path, ref: str) -> str | None:
    """The other worktree where branch ``ref`` (``refs/heads/...``) is checked out, or None;
    git refuses to check one branch out twice, and a second checkout would show the first
    one's commits as staged reverts."""
    here = Path(git_text("rev-parse", "--show-toplevel", cwd=repo)).resolve()
    held = git_text("for-each-ref", "--format=%(worktreepath)", "--end-of-options", ref, cwd=repo)
    if held and Path(held).resolve() != here:
        return held
    return None


def symbolic_head(repo: str | Path) -> str | None:
    """``refs/heads/<name>`` HEAD points to, or None when HEAD is detached."""
    out = git("symbolic-ref", "-q", "HEAD", cwd=repo, check=False).decode().strip()
    return out or None


def diff(repo: str | Path, old: str, new: str, paths: Sequence[str] = ()) -> bytes:
    """The normalized diff between two commits (see DIFF_ARGS)."""
    return git(*DIFF_ARGS, "--end-of-options", old, new, "--", *paths, cwd=repo)


def write_tree(
    repo: str | Path,
    changes: Mapping[str, tuple[str, bytes] | None],
    base: str | None = None,
) -> str:
    """Write ``base`` (a tree-ish; None = empty) with ``changes`` applied as a new tree object.

    ``changes`` maps a path to ``(mode, content)``, or to None to delete it. Only objects are
    written, through a private index in a scratch folder (named after our pid, so the next run
    removes it if we are killed): the user's index, work tree and refs are not touched.
    Contents are hashed with ``--no-filters`` so no attribute or line-ending rule alters them.
    """
    with scratch.folder(git_dir(repo), scratch.GIT_PREFIX) as tmp:
        items = sorted(changes.items())
        files = []
        for n, (_, change) in enumerate(c for c in items if c[1] is not None):
            path = tmp / f"blob{n}"
            path.write_bytes(change[1])
            files.append(str(path))
        blobs = iter(
            git_text(
                "hash-object",
                "-w",
                "--no-filters",
                "--stdin-paths",
                cwd=repo,
                input=("\n".join(files) + "\n").encode(),
            ).split()
            if files
            else []
        )
        entries = [
            f"0 {ZERO_OID}\t{path}" if change is None else f"{change[0]} {next(blobs)}\t{path}"
            for path, change in items
        ]
        env = {"GIT_INDEX_FILE": str(tmp / "index")}
        if base:
            git("read-tree", "--end-of-options", base, cwd=repo, env=env)
        if entries:  # NUL-terminated: a path may hold a newline, a tab or a quote
            git(
                "update-index",
                "--add",
                "-z",
                "--index-info",
                cwd=repo,
                env=env,
                input=("\0".join(entries) + "\0").encode("utf-8", errors="surrogateescape"),
            )
        return git_text("write-tree", cwd=repo, env=env)


def merge_file(repo: str | Path, ours: bytes, base: bytes, theirs: bytes) -> bytes | None:
    """``git merge-file -p`` on three contents; None when the merge conflicts."""
    with tempfile.TemporaryDirectory(prefix="megatron-rocm-merge-") as tmp:
        paths = []
        for name, data in (("ours", ours), ("base", base), ("theirs", theirs)):
            p = Path(tmp) / name
            p.write_bytes(data)
            paths.append(str(p))
        try:
            out = git("merge-file", "-p", "--end-of-options", *paths, cwd=repo)
        except GitError:
            return None
    return out


def _reason(lines: Sequence[str], code: int) -> str:
    """git's own last 'fatal:'/'error:' line (or its last line) for a one-line message."""
    fatal = [ln for ln in lines if ln.startswith(("fatal:", "error:"))]
    return (fatal or list(lines) or [f"exit code {code}"])[-1]


def stream(args: Sequence[str], cwd: str | Path, what: str, quiet: bool = False) -> None:
    """Run a long git command (clone, fetch) showing its progress on stderr.

    Progress lines are parsed by GitPython's ``RemoteProgress`` (``progress.CloneProgress``);
    on failure the GitError names ``what`` and git's own reason. An interrupt kills git.
    """
    from megatron_rocm.progress import CloneProgress

    progress = CloneProgress(quiet)
    handle = progress.new_message_handler()
    tail: collections.deque[str] = collections.deque(maxlen=40)
    proc = subprocess.Popen(
        argv(*args),
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        **_spawn_args(None),
    )
    try:
        assert proc.stderr is not None
        pending = b""
        while chunk := proc.stderr.read1(65536):
            *done, pending = re.split(rb"[\r\n]", pending + chunk)
            for raw in done:
                line = raw.decode("utf-8", errors="replace").strip()
                if line:
                    handle(line)
                    if "%" not in line:
                        tail.append(line)
        if pending.strip():
            tail.append(pending.decode("utf-8", errors="replace").strip())
        code = proc.wait()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    if code != 0:
        reason = _reason(list(tail), code)
        raise GitError(f"{what}: {reason}", reason=reason)


def clone(
    origin: str, dest: Path, *, bare: bool = False, blobless: bool = False, **kw: Any
) -> None:
    """Clone ``origin`` (a URL or an absolute path) into ``dest``, without a checkout."""
    opts = ["clone", "--progress", "--no-checkout"]
    opts += ["--bare"] if bare else []
    opts += ["--filter=blob:none"] if blobless else []
    stream(
        [*opts, "--end-of-options", origin, str(dest)], dest.parent, f"cannot clone {origin}", **kw
    )


def fetch(
    repo: Path, source: str, refspecs: Sequence[str], *, prune: bool = False, **kw: Any
) -> None:
    """Fetch ``refspecs`` from ``source``; with a bare name, into FETCH_HEAD only (no ref moves)."""
    opts = ["fetch", "--progress", "--no-tags"]
    opts += ["--prune"] if prune else []
    stream(
        [*opts, "--end-of-options", source, *refspecs], repo, f"cannot fetch from {source}", **kw
    )


class CatFile:
    """A long-lived ``git cat-file --batch`` reader: one process for thousands of blob reads."""

    def __init__(self, repo: str | Path) -> None:
        self._proc = subprocess.Popen(
            argv("cat-file", "--batch"),
            cwd=repo,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            **_spawn_args(None),
        )

    def read(self, spec: str) -> bytes | None:
        """Contents of ``<rev>:<path>`` or an object id; None when it does not exist."""
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(spec.encode("utf-8", errors="surrogateescape") + b"\n")
        self._proc.stdin.flush()
        header = self._proc.stdout.readline()
        if not header:
            raise GitError(f"git cat-file stopped while reading {spec}")
        parts = header.split()
        if len(parts) < 3 or parts[1] == b"missing" or parts[-1] == b"missing":
            return None
        size = int(parts[2])
        data = self._proc.stdout.read(size)
        self._proc.stdout.read(1)  # the newline after the object
        if parts[1] != b"blob":
            return None
        return data

    def close(self) -> None:
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            with contextlib.suppress(OSError):
                self._proc.stdin.close()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def __enter__(self) -> CatFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
