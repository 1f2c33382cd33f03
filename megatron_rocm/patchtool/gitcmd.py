"""The one thin layer through which every git command runs.

Why a layer of our own: exported diffs must be byte-stable on every machine, so each command
runs with the user's and the system's git configuration ignored, a fixed locale, and explicit
diff options. Long-running reads go through one ``git cat-file --batch`` process.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from megatron_rocm.errors import FatalError, SourceError

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
)

IDENTITY = {
    "GIT_AUTHOR_NAME": "megatron-rocm",
    "GIT_AUTHOR_EMAIL": "megatron-rocm@users.noreply.github.com",
    "GIT_COMMITTER_NAME": "megatron-rocm",
    "GIT_COMMITTER_EMAIL": "megatron-rocm@users.noreply.github.com",
}

ZERO_OID = "0" * 40


class GitError(FatalError):
    """A git command failed; the message names the command and git's own words."""


def git_binary() -> str:
    path = shutil.which("git")
    if path is None:
        raise SourceError("git is not installed or not on PATH; install git and try again")
    return path


def sanitized_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """os.environ without GIT_* (a hook's GIT_DIR must not leak in), config files ignored."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(
        GIT_CONFIG_NOSYSTEM="1",
        GIT_CONFIG_GLOBAL=os.devnull,
        GIT_TERMINAL_PROMPT="0",
        LC_ALL="C",
        LANG="C",
    )
    # Keep proxy/credential settings out of it deliberately: sources are local or https.
    if extra:
        env.update(extra)
    return env


def git(
    *args: str,
    cwd: str | Path,
    input: bytes | None = None,
    env: Mapping[str, str] | None = None,
    check: bool = True,
) -> bytes:
    """Run ``git <args>`` in ``cwd`` and return stdout; raise GitError on failure."""
    cmd = [git_binary(), "-c", "core.quotepath=false", "-c", "core.autocrlf=false", *args]
    try:
        proc = subprocess.run(
            cmd, cwd=cwd, input=input, env=sanitized_env(env), capture_output=True, check=False
        )
    except FileNotFoundError as e:
        raise SourceError(f"cannot run git in {cwd}: {e.strerror}") from None
    except PermissionError as e:
        raise SourceError(f"permission denied running git in {cwd}: {e}") from None
    if check and proc.returncode != 0:
        msg = proc.stderr.decode(errors="replace").strip().splitlines()
        last = msg[-1] if msg else f"exit code {proc.returncode}"
        raise GitError(f"git {' '.join(args[:3])} failed: {last}")
    return proc.stdout


def git_text(*args: str, cwd: str | Path, **kw: object) -> str:
    return git(*args, cwd=cwd, **kw).decode("utf-8", errors="surrogateescape").strip()  # type: ignore[arg-type]


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
    out = git_text("rev-parse", "--absolute-git-dir", cwd=repo)
    return Path(out)


def rev_parse(repo: str | Path, rev: str) -> str | None:
    """Full commit id of ``rev`` or None when it does not name a commit."""
    try:
        return git_text("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}", cwd=repo)
    except GitError:
        return None


def diff(repo: str | Path, old: str, new: str, paths: Sequence[str] = ()) -> bytes:
    """The normalized diff between two commits (see DIFF_ARGS)."""
    return git(*DIFF_ARGS, old, new, "--", *paths, cwd=repo)


def write_tree(
    repo: str | Path,
    changes: Mapping[str, tuple[str, bytes] | None],
    base: str | None = None,
) -> str:
    """Write ``base`` (a tree-ish; None = empty) with ``changes`` applied as a new tree object.

    ``changes`` maps a path to ``(mode, content)``, or to None to delete it. Only objects are
    written, through a private index: the user's index, work tree and refs are not touched.
    Contents are hashed with ``--no-filters`` so no attribute or line-ending rule alters them.
    """
    with tempfile.TemporaryDirectory(prefix="megatron-rocm-", dir=git_dir(repo)) as tmp:
        items = sorted(changes.items())
        files = []
        for n, (_, change) in enumerate(c for c in items if c[1] is not None):
            path = Path(tmp) / f"blob{n}"
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
        env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
        if base:
            git("read-tree", base, cwd=repo, env=env)
        if entries:
            git(
                "update-index",
                "--add",
                "--index-info",
                cwd=repo,
                env=env,
                input=("\n".join(entries) + "\n").encode("utf-8", errors="surrogateescape"),
            )
        return git_text("write-tree", cwd=repo, env=env)


class CatFile:
    """A long-lived ``git cat-file --batch`` reader: one process for thousands of blob reads."""

    def __init__(self, repo: str | Path) -> None:
        self._proc = subprocess.Popen(
            [git_binary(), "cat-file", "--batch"],
            cwd=repo,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=sanitized_env(),
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
            self._proc.stdin.close()
            self._proc.wait(timeout=10)

    def __enter__(self) -> CatFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
