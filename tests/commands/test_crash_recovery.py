"""SIGKILL in the middle of the work-tree switch of an apply into an existing fork.

The toy upstream's two refs differ in every kind of content git can hold: a symlinked folder,
a symlink retargeted, a file that becomes a folder and a folder that becomes a file, a folder
that becomes a symlink, an executable bit, deleted files, submodule gitlinks (changed, added,
removed) and many regular files. The fork is an apply of ref ``a``; the apply of ref ``b`` is
killed while git writes the work tree, deterministically: a smudge filter the test installs
in the fork counts the files git writes and, at the N-th, SIGKILLs the apply's process group,
either alone (git, in its own group, writes on to the end: a Ctrl-\\ or a ``kill -9`` of the
terminal's group) or together with git's group (everything dies half way).

The next run must bring the fork to exactly "after" (an uninterrupted apply of ``b``): HEAD,
branch, refs, index, every path's kind, mode, content or link target, no leftovers; never a
state in between, never exit 3 for a tree it wrote itself.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from toyrepo import apply_argv, leftovers, make_series, make_upstream, run

from megatron_rocm.main import main
from megatron_rocm.patchtool import gitcmd, switch

# fault injection: many killed applies (the CLI's other fault files too)
pytestmark = pytest.mark.full

MANY = 40  # regular files changed between the refs, so the filter has points to stop at


def _gitlink(repo: Path, path: str, commit: str) -> None:
    run("update-index", "--add", "--cacheinfo", f"160000,{commit},{path}", cwd=repo)


def _files(repo: Path, tree: dict[str, str | None]) -> None:
    """Write (str), symlink ("-> target") or delete (None) each path, then stage all."""
    for rel, content in tree.items():
        path = repo / rel
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.is_dir():
            shutil.rmtree(path)
        if content is None:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        if content.startswith("-> "):
            path.symlink_to(content[3:])
        else:
            path.write_text(content)
    run("add", "-A", cwd=repo)


def _make_refs(upstream: Path) -> None:
    """Branches ``a`` and ``b`` off core_v0.2.0 (where the toy series applies)."""
    run("checkout", "-q", "-b", "a", "core_v0.2.0", cwd=upstream)
    blob_x = run("rev-parse", "core_v0.1.0", cwd=upstream)
    blob_y = run("rev-parse", "core_v0.2.0", cwd=upstream)
    tree_a: dict[str, str | None] = {f"many/f{i:03}.py": f"a {i}\n" for i in range(MANY)}
    tree_a |= {
        "skills/s.md": "skill\n",
        "ln_file": "-> README.md",
        "swap_fd": "a file that becomes a folder\n",
        "swap_df/x.txt": "a folder that becomes a file\n",
        "dir_to_link/inner.txt": "a folder that becomes a symlink\n",
        "tool.sh": "#!/bin/sh\necho tool\n",
        "gone.txt": "deleted in b\n",
        "gone/deep/g.txt": "deleted with its folders in b\n",
    }
    _files(upstream, tree_a)
    _gitlink(upstream, "sub", blob_x)
    _gitlink(upstream, "sub_gone", blob_x)
    run("commit", "-q", "-m", "a", cwd=upstream)

    run("checkout", "-q", "-b", "b", "a", cwd=upstream)
    tree_b: dict[str, str | None] = {f"many/f{i:03}.py": f"b {i}\n" for i in range(MANY)}
    tree_b |= {
        ".agents/skills": "-> ../skills",
        "ln_file": "-> megatron/core/norm.py",
        "swap_fd": None,
        "swap_fd/inner.txt": "now inside a folder\n",
        "swap_df": "now a file\n",
        "dir_to_link": "-> skills",
        "gone.txt": None,
        "gone": None,
        "zz_added/new.txt": "new in b\n",
    }
    _files(upstream, tree_b)
    run("update-index", "--chmod=+x", "tool.sh", cwd=upstream)
    run("update-index", "--force-remove", "sub_gone", cwd=upstream)
    _gitlink(upstream, "sub", blob_y)
    _gitlink(upstream, "sub_new", blob_y)
    run("commit", "-q", "-m", "b", cwd=upstream)


def state(repo: Path) -> tuple:
    """HEAD (symbolic and commit), refs, the index, status, and every path below the work
    tree (kind, mode, content or link target), empty folders included."""
    head = run("rev-parse", "HEAD", cwd=repo)
    symbolic = run("symbolic-ref", "-q", "HEAD", cwd=repo, check=False)
    refs = run("for-each-ref", "--format=%(refname) %(objectname)", cwd=repo)
    index = run("ls-files", "--stage", cwd=repo)
    status = run("status", "--porcelain", "--untracked-files=all", "--ignored", cwd=repo)
    paths = []
    for top, dirs, files in os.walk(repo):
        dirs[:] = sorted(d for d in dirs if d != ".git" or Path(top) != repo)
        rel = Path(top).relative_to(repo)
        for name in [*dirs, *sorted(files)]:
            p = Path(top) / name
            st = p.lstat()
            if p.is_symlink():
                paths.append(f"{rel / name} -> {os.readlink(p)}")
            elif p.is_dir():
                paths.append(f"{rel / name}/ {'empty' if not any(p.iterdir()) else ''}")
            else:
                paths.append(f"{rel / name} {st.st_mode:o} {p.read_bytes()!r}")
    return head, symbolic, refs, index, status, tuple(paths)


@dataclass
class World:
    upstream: Path
    series: Path
    fork_a: Path  # an apply of ref a
    before: tuple
    after: tuple  # the fork after an uninterrupted apply of ref b


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    from toyrepo import seal

    root = tmp_path_factory.mktemp("crash")
    with pytest.MonkeyPatch.context() as mp:
        seal(mp, root / "home")
        upstream = make_upstream(root)
        _make_refs(upstream)
        series = make_series(root, upstream)
        fork_a = root / "fork-a"
        assert main(apply_argv(upstream, series, fork_a, "a")) == 0
        done = root / "done"
        shutil.copytree(fork_a, done, symlinks=True)
        assert main(apply_argv(upstream, series, done, "b")) == 0
        world = World(upstream, series, fork_a, state(fork_a), state(done))
    assert world.before != world.after
    return world


FILTER = """#!/bin/bash
n=$(cat "$CRASH_DIR/count" 2>/dev/null || echo 0)
n=$((n + 1))
echo "$n" > "$CRASH_DIR/count"
if [ "$n" = "$CRASH_AT" ]; then
  kill -KILL -- "-$(cat "$CRASH_DIR/apply.pid")"
  if [ "$CRASH_WHO" = all ]; then kill -KILL 0; fi
fi
exec cat
"""


def _install_filter(fork: Path, crash: Path) -> None:
    script = crash / "filter.sh"
    script.write_text(FILTER)
    run("config", "filter.crash.smudge", f"bash {script}", cwd=fork)
    (fork / ".git" / "info").mkdir(exist_ok=True)
    (fork / ".git" / "info" / "attributes").write_text("* filter=crash\n")


def _remove_filter(fork: Path) -> None:
    run("config", "--remove-section", "filter.crash", cwd=fork)
    (fork / ".git" / "info" / "attributes").unlink()


def _lock_released(fork: Path) -> bool:
    """True once no process (git, which inherits the apply's lock, writing on) holds it."""
    try:
        fd = os.open(fork / ".git" / "megatron-rocm.lock", os.O_RDONLY)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def _kill_during_checkout(world: World, fork: Path, crash: Path, at: int, who: str) -> None:
    env = {**os.environ, "CRASH_DIR": str(crash), "CRASH_AT": str(at), "CRASH_WHO": who}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "megatron_rocm",
            *apply_argv(world.upstream, world.series, fork, "b"),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own group: the filter kills that group, not pytest
    )
    (crash / "apply.pid").write_text(str(proc.pid))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, err.decode()
    deadline = time.monotonic() + 60
    while not _lock_released(fork) and time.monotonic() < deadline:  # "python": git writes on
        time.sleep(0.05)
    assert _lock_released(fork)


@pytest.mark.parametrize("who", ["all", "python"])
@pytest.mark.parametrize("at", [1, 2, 5, 12, 25, MANY - 1, MANY + 1])
def test_killed_during_checkout_next_run_ends_exactly_after(world, tmp_path, capsys, at, who):
    fork = tmp_path / "fork"
    shutil.copytree(world.fork_a, fork, symlinks=True)
    crash = tmp_path / "crash"
    crash.mkdir()
    _install_filter(fork, crash)
    _kill_during_checkout(world, fork, crash, at, who)
    _remove_filter(fork)
    assert state(fork) != world.after  # killed half way (or before HEAD moved)

    code = main(apply_argv(world.upstream, world.series, fork, "b"))
    err = capsys.readouterr().err
    assert code == 0, err
    assert "Traceback" not in err
    assert "finishing an apply of rocm/b" in err
    assert state(fork) == world.after
    assert leftovers(fork) == []


def test_a_failure_of_our_own_plumbing_during_recovery_is_exit_4(
    world, tmp_path, capsys, monkeypatch
):
    """Checking a half-switched work tree only reads what git wrote and our own commits: a
    git failure there is a bug of ours (exit 4, traceback logged), not the environment's."""
    fork = tmp_path / "fork"
    shutil.copytree(world.fork_a, fork, symlinks=True)
    crash = tmp_path / "crash"
    crash.mkdir()
    _install_filter(fork, crash)
    _kill_during_checkout(world, fork, crash, 5, "all")
    _remove_filter(fork)

    def broken(*_a, **_k):
        raise gitcmd.GitError("git hash-object --stdin-paths failed: fatal: Unable to hash x")

    monkeypatch.setattr(switch, "_on_disk", broken)
    assert main(apply_argv(world.upstream, world.series, fork, "b")) == 4
    assert "internal error" in capsys.readouterr().err


FAILING = """#!/bin/bash
n=$(cat "$CRASH_DIR/count" 2>/dev/null || echo 0)
n=$((n + 1))
echo "$n" > "$CRASH_DIR/count"
if [ "$n" = "$CRASH_AT" ]; then cat > /dev/null; exit 1; fi
exec cat
"""


@pytest.mark.parametrize("at", [1, 12, MANY + 1])
def test_a_checkout_that_fails_half_way_is_rolled_back_exactly(
    world, tmp_path, capsys, monkeypatch, at
):
    """git fails on the N-th file (a full disk, a file it cannot write): the fork is put back
    exactly as it was, whatever kinds of entries had been switched, and the next run applies."""
    fork = tmp_path / "fork"
    shutil.copytree(world.fork_a, fork, symlinks=True)
    crash = tmp_path / "crash"
    crash.mkdir()
    (crash / "filter.sh").write_text(FAILING)
    run("config", "filter.crash.smudge", f"bash {crash / 'filter.sh'}", cwd=fork)
    run("config", "filter.crash.clean", "cat", cwd=fork)
    run("config", "filter.crash.required", "true", cwd=fork)
    (fork / ".git" / "info").mkdir(exist_ok=True)
    (fork / ".git" / "info" / "attributes").write_text("* filter=crash\n")
    monkeypatch.setenv("CRASH_DIR", str(crash))
    monkeypatch.setenv("CRASH_AT", str(at))

    assert main(apply_argv(world.upstream, world.series, fork, "b")) == 3
    err = capsys.readouterr().err
    assert "nothing was changed" in err and "Traceback" not in err, err
    _remove_filter(fork)
    assert state(fork) == world.before
    assert leftovers(fork) == []
    assert main(apply_argv(world.upstream, world.series, fork, "b")) == 0
    assert state(fork) == world.after


def test_a_rewritten_file_that_looks_unchanged_by_its_stat_data_is_still_put_back(
    world, tmp_path, capsys, monkeypatch
):
    """git's timestamps are whole seconds: a file the failed switch rewrote at the same size
    within the second of the fork's own checkout has the stat data the index recorded for the
    old version. Undoing the switch must not trust it (``core.checkStat=minimal`` and the old
    mtimes put back make that deterministic here)."""
    fork = tmp_path / "fork"
    shutil.copytree(world.fork_a, fork, symlinks=True)
    run("config", "core.checkStat", "minimal", cwd=fork)
    run("config", "core.trustctime", "false", cwd=fork)
    run("update-index", "--refresh", cwd=fork)
    many = sorted((fork / "many").iterdir())
    stamps = {p: p.stat().st_mtime_ns for p in many}  # "a N" and "b N": the same size
    real = gitcmd.git

    def failing(*args, **kw):
        out = real(*args, **kw)
        if args[:3] == ("read-tree", "-m", "-u") and "-n" not in args:
            for path, ns in stamps.items():
                os.utime(path, ns=(ns, ns))
            raise gitcmd.GitError("git read-tree -m -u failed: disk full", reason="disk full")
        return out

    with monkeypatch.context() as patched:
        patched.setattr(gitcmd, "git", failing)
        assert main(apply_argv(world.upstream, world.series, fork, "b")) == 3
    assert "nothing was changed" in capsys.readouterr().err
    assert [p.read_text() for p in many] == [f"a {i}\n" for i in range(MANY)]
    run("config", "--unset", "core.checkStat", cwd=fork)
    run("config", "--unset", "core.trustctime", cwd=fork)
    assert state(fork) == world.before
