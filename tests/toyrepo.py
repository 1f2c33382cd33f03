"""A synthetic, Megatron-shaped upstream repo with tags that exercise every hunk label.

No upstream code: the files are generated lines. Tags and what they do to the two patches
(``p-softmax`` edits softmax.py line 20; ``p-norm`` edits norm.py lines 10 and 14):

- core_v0.1.0  the base both diffs were made on                 -> clean
- core_v0.2.0  5 lines inserted at the top of both files        -> offset
- core_v0.3.0  norm.py: outermost context line changed          -> fuzz
               softmax.py: the line next to the change changed  -> conflict
- core_v0.4.0  norm.py deleted                                  -> file-gone
- core_v0.5.0  softmax.py already carries the change            -> already-applied
- core_v0.6.0  norm.py: the line between the two edits changed  -> needs-3-way
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest

from megatron_rocm.patchtool.gitcmd import DIFF_ARGS

SOFTMAX = "megatron/core/fusions/softmax.py"
NORM = "megatron/core/norm.py"


def seal(monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    """The hermetic test environment (conftest's autouse fixture; module-scoped builders):
    private HOME and cache, no user git config, fixed identity and dates, no fault injection,
    the default norm routing."""
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CACHE_HOME", str(home / ".cache"))
    monkeypatch.delenv("MEGATRON_ROCM_SERIES", raising=False)
    monkeypatch.setenv("MEGATRON_ROCM_CACHE", str(home / ".cache" / "megatron-rocm"))
    for key in list(os.environ):
        if key.startswith("GIT_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", os.devnull)
    monkeypatch.setenv("GIT_AUTHOR_NAME", "Test Author")
    monkeypatch.setenv("GIT_AUTHOR_EMAIL", "author@example.invalid")
    monkeypatch.setenv("GIT_COMMITTER_NAME", "Test Author")
    monkeypatch.setenv("GIT_COMMITTER_EMAIL", "author@example.invalid")
    monkeypatch.setenv("GIT_AUTHOR_DATE", "2025-01-01T00:00:00+0000")
    monkeypatch.setenv("GIT_COMMITTER_DATE", "2025-01-01T00:00:00+0000")
    monkeypatch.setenv("GIT_EDITOR", "false")
    # no fault injection, and the runtime's default kernel routing
    for key in ("MEGATRON_ROCM_FAULT", "MEGATRON_ROCM_FAULT_READY", "MEGATRON_ROCM_TRITON_NORMS"):
        monkeypatch.delenv(key, raising=False)


def run(*args: str, cwd: Path, check: bool = True) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, check=check, capture_output=True, text=True
    ).stdout.strip()


def lines(prefix: str, n: int) -> list[str]:
    return [f"{prefix}_{i} = {i}\n" for i in range(1, n + 1)]


def write(repo: Path, rel: str, content: list[str] | None) -> None:
    path = repo / rel
    if content is None:
        path.unlink()
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(content))


def package_info(minor: int, pre: str = "") -> list[str]:
    return ["MAJOR = 0\n", f"MINOR = {minor}\n", "PATCH = 0\n", f"PRE_RELEASE = '{pre}'\n"]


def commit_all(repo: Path, message: str) -> str:
    run("add", "-A", cwd=repo)
    run("commit", "-q", "-m", message, cwd=repo)
    return run("rev-parse", "HEAD", cwd=repo)


def softmax_patched(base: list[str]) -> list[str]:
    out = list(base)
    i = out.index("softmax_20 = 20\n")
    out[i] = "softmax_20 = 'rocm'\n"
    return out


def norm_patched(base: list[str]) -> list[str]:
    out = list(base)
    out[out.index("norm_10 = 10\n")] = "norm_10 = 'ten'\n"
    out[out.index("norm_14 = 14\n")] = "norm_14 = 'fourteen'\n"
    return out


def make_upstream(root: Path) -> Path:
    repo = root / "upstream"
    repo.mkdir()
    run("init", "-q", "-b", "main", cwd=repo)
    soft, norm = lines("softmax", 40), lines("norm", 30)
    write(repo, "megatron/core/package_info.py", package_info(1))
    write(repo, SOFTMAX, soft)
    write(repo, NORM, norm)
    write(repo, "README.md", ["toy upstream\n"])
    commit_all(repo, "v0.1.0")
    run("tag", "core_v0.1.0", cwd=repo)

    pad = [f"# new upstream line {i}\n" for i in range(5)]
    write(repo, "megatron/core/package_info.py", package_info(2))
    write(repo, SOFTMAX, pad + soft)
    write(repo, NORM, pad + norm)
    commit_all(repo, "v0.2.0")
    run("tag", "core_v0.2.0", cwd=repo)

    soft3 = [ln.replace("softmax_19 = 19", "softmax_19 = 'changed'") for ln in pad + soft]
    norm3 = [ln.replace("norm_7 = 7", "norm_7 = 'changed'") for ln in pad + norm]
    write(repo, "megatron/core/package_info.py", package_info(3))
    write(repo, SOFTMAX, soft3)
    write(repo, NORM, norm3)
    commit_all(repo, "v0.3.0")
    run("tag", "core_v0.3.0", cwd=repo)

    write(repo, "megatron/core/package_info.py", package_info(4))
    write(repo, SOFTMAX, pad + soft)
    write(repo, NORM, None)
    commit_all(repo, "v0.4.0")
    run("tag", "core_v0.4.0", cwd=repo)

    write(repo, "megatron/core/package_info.py", package_info(5))
    write(repo, SOFTMAX, softmax_patched(pad + soft))
    write(repo, NORM, pad + norm)
    commit_all(repo, "v0.5.0")
    run("tag", "core_v0.5.0", cwd=repo)

    norm6 = [ln.replace("norm_12 = 12", "norm_12 = 'upstream'") for ln in pad + norm]
    write(repo, "megatron/core/package_info.py", package_info(6, "rc0"))
    write(repo, SOFTMAX, pad + soft)
    write(repo, NORM, norm6)
    commit_all(repo, "v0.6.0rc0")
    run("tag", "core_v0.6.0", cwd=repo)
    return repo


def make_series(root: Path, upstream: Path) -> Path:
    """Two patches made the way a developer would: commits on a clone, diffs via git."""
    work = root / "series-work"
    run("clone", "-q", str(upstream), str(work), cwd=root)
    run("checkout", "-q", "-b", "dev", "core_v0.1.0", cwd=work)
    series = root / "patches"
    series.mkdir()
    specs = [
        ("p-softmax", "Softmax without the vendor kernel", SOFTMAX, softmax_patched),
        ("p-norm", "Norm without assertions", NORM, norm_patched),
    ]
    for pid, reason, rel, change in specs:
        before = (work / rel).read_text().splitlines(keepends=True)
        write(work, rel, change(before))
        commit_all(work, reason)
        # exactly how a developer makes them: the project's pinned diff options
        diff = subprocess.run(
            ["git", *DIFF_ARGS, "HEAD^", "HEAD"], cwd=work, check=True, capture_output=True
        ).stdout
        (series / pid).mkdir()
        (series / pid / "v0.1.diff").write_bytes(diff)
        (series / pid / "patch.toml").write_text(
            f'id = "{pid}"\nreason = "{reason}"\nupstream = "not-submitted"\n\n'
            '[[variant]]\ndiff = "v0.1.diff"\nsince = "0.1.0"\n'
        )
    (series / "series").write_text("# toy series\np-softmax\np-norm\n")
    return series


def apply_argv(upstream: Path, series: Path, dest: Path, ref: str = "core_v0.2.0") -> list[str]:
    """``megatron-rocm apply`` arguments for the toy upstream and series."""
    return [
        "apply",
        "--source",
        str(upstream),
        "--series",
        str(series),
        "--ref",
        ref,
        "--dest",
        str(dest),
    ]


def snapshot(repo: Path) -> tuple[str, ...]:
    """Everything apply must leave untouched on failure: HEAD (symbolic and commit), refs, the
    index, status, and every working file's content hash and mode."""
    head = run("rev-parse", "HEAD", cwd=repo) if (repo / ".git").exists() else ""
    symbolic = subprocess.run(
        ["git", "symbolic-ref", "-q", "HEAD"], cwd=repo, capture_output=True, text=True
    ).stdout.strip()
    refs = run("for-each-ref", "--format=%(refname) %(objectname)", cwd=repo)
    index = run("ls-files", "--stage", cwd=repo)
    status = run("status", "--porcelain", "--untracked-files=all", "--ignored", cwd=repo)
    files = "\n".join(
        f"{p.relative_to(repo)}:{hashlib.sha256(p.read_bytes()).hexdigest()}:{p.stat().st_mode:o}"
        for p in sorted(repo.rglob("*"))
        if p.is_file() and ".git" not in p.relative_to(repo).parts
    )
    return head, symbolic, refs, index, status, files


def leftovers(dest: Path) -> list[str]:
    """What megatron-rocm may leave behind for ``dest``: scratch clones and the lock beside
    it, the lock, journal, private index and scratch folders in its git dir."""
    found = [p.name for p in dest.parent.glob(f".{dest.name}.*")]
    git_dir = dest / ".git"
    if git_dir.is_dir():
        found += [f".git/{p.name}" for p in git_dir.glob("megatron-rocm*")]
    return sorted(found)
