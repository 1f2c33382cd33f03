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

import subprocess
from pathlib import Path

from megatron_rocm.patchtool.gitcmd import DIFF_ARGS

SOFTMAX = "megatron/core/fusions/softmax.py"
NORM = "megatron/core/norm.py"


def run(*args: str, cwd: Path) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, text=True
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


def snapshot(repo: Path) -> tuple[str, str, str, str]:
    """Everything apply must leave untouched on failure: HEAD, refs, status, working files."""
    head = run("rev-parse", "HEAD", cwd=repo) if (repo / ".git").exists() else ""
    refs = run("for-each-ref", "--format=%(refname) %(objectname)", cwd=repo)
    status = run("status", "--porcelain", "--untracked-files=all", cwd=repo)
    files = "\n".join(
        f"{p.relative_to(repo)}:{p.read_bytes().hex()[:64]}:{p.stat().st_size}"
        for p in sorted(repo.rglob("*"))
        if p.is_file() and ".git" not in p.parts
    )
    return head, refs, status, files
