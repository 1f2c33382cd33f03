"""apply: fork branch, idempotence, atomic failure, kill mid-apply, dirty trees, locking."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from toyrepo import apply_argv, leftovers, run, snapshot

from megatron_rocm.errors import EXIT_BUSY
from megatron_rocm.main import main
from megatron_rocm.patchtool.lock import LOCK_NAME


def one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    return err


def _apply(upstream, series, dest, ref="core_v0.2.0", *extra):
    return main([*apply_argv(upstream, series, dest, ref), *extra])


def test_apply_creates_fork_branch_with_one_commit_per_patch(toy, capsys):
    root, upstream, series = toy
    dest = root / "fork"
    assert _apply(upstream, series, dest) == 0
    assert run("rev-parse", "--abbrev-ref", "HEAD", cwd=dest) == "rocm/core_v0.2.0"
    log = run(
        "log",
        "--format=%s|%(trailers:key=Megatron-ROCm-Patch,valueonly)",
        "core_v0.2.0..HEAD",
        cwd=dest,
    ).splitlines()
    assert [ln.split("|")[1] for ln in log if "|" in ln] == ["p-norm", "p-softmax"]
    assert "softmax_20 = 'rocm'" in (dest / "megatron/core/fusions/softmax.py").read_text()
    assert run("status", "--porcelain", cwd=dest) == ""
    assert "created branch rocm/core_v0.2.0 (2 commits" in capsys.readouterr().out


def test_apply_is_deterministic_and_idempotent(toy, capsys):
    root, upstream, series = toy
    a, b = root / "a", root / "b"
    assert _apply(upstream, series, a) == 0
    assert _apply(upstream, series, b) == 0
    assert run("rev-parse", "HEAD", cwd=a) == run("rev-parse", "HEAD", cwd=b)
    before = snapshot(a)
    capsys.readouterr()
    assert _apply(upstream, series, a) == 0
    assert "already applied" in capsys.readouterr().out
    assert snapshot(a) == before


def test_conflict_in_patch_k_of_n_leaves_existing_clone_untouched(toy, capsys):
    root, upstream, series = toy
    dest = root / "clone"
    run("clone", "-q", str(upstream), str(dest), cwd=root)
    run("checkout", "-q", "core_v0.3.0", cwd=dest)
    before = snapshot(dest)
    assert _apply(upstream, series, dest, "core_v0.3.0") == 1
    err = capsys.readouterr().err
    assert "p-softmax" in err and "megatron/core/fusions/softmax.py hunk 1" in err
    assert "nothing was changed" in err and "Traceback" not in err
    assert snapshot(dest) == before


def test_failed_fresh_apply_leaves_no_destination(toy, capsys):
    root, upstream, series = toy
    dest = root / "new"
    assert _apply(upstream, series, dest, "core_v0.4.0") == 1
    assert ".apply-" not in capsys.readouterr().err  # never names a deleted scratch clone
    assert not dest.exists()
    assert [p.name for p in root.iterdir() if p.name.startswith(".new")] == []


def test_an_empty_destination_keeps_its_mode_and_a_read_only_one_is_refused(toy, capsys):
    """The fork is renamed onto the empty folder the user made, so it takes over that folder's
    bits (here private and setgid); a folder without write bits is left as it was, exit 3."""
    root, upstream, series = toy
    mine = root / "mine"
    mine.mkdir()
    mine.chmod(0o2750)
    assert _apply(upstream, series, mine) == 0
    assert oct(mine.stat().st_mode & 0o7777) == oct(0o2750)
    assert run("status", "--porcelain", cwd=mine) == ""
    capsys.readouterr()

    locked = root / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        assert _apply(upstream, series, locked) == 3
        assert "it is read-only (mode 555); nothing was changed" in one_line(capsys)
        assert list(locked.iterdir()) == []
        assert oct(locked.stat().st_mode & 0o7777) == oct(0o555)
        assert [p.name for p in root.iterdir() if p.name.startswith(".locked")] == []
    finally:
        locked.chmod(0o755)


def test_closed_stdout_does_not_undo_or_fail_a_finished_apply(toy):
    """`apply --json | head -0`: the reader is gone before the report; the fork stays and the
    exit code is apply's own, with nothing on stderr."""
    root, upstream, series = toy
    dest = root / "piped"
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "megatron_rocm", *apply_argv(upstream, series, dest), "--json"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
        )
    finally:
        os.close(write_end)
    assert (proc.returncode, proc.stderr) == (0, "")
    assert run("rev-parse", "--abbrev-ref", "HEAD", cwd=dest) == "rocm/core_v0.2.0"
    assert leftovers(dest) == []


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_report_that_cannot_be_written_says_the_apply_finished(toy):
    """`apply > /dev/full` on an existing fork: the branch is made before the report, and the
    one line says so (a fresh apply prints progress first, so it stops before any change)."""
    root, upstream, series = toy
    dest = root / "full"
    assert _apply(upstream, series, dest) == 0
    argv = [*apply_argv(upstream, series, dest), "--branch", "second"]
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            [sys.executable, "-m", "megatron_rocm", *argv],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
        )
    assert proc.returncode == 3
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "the apply itself finished: second is checked out in" in proc.stderr
    assert run("rev-parse", "--abbrev-ref", "HEAD", cwd=dest) == "second"


def test_dirty_tree_is_refused_and_edits_kept(toy, capsys):
    root, upstream, series = toy
    dest = root / "clone"
    run("clone", "-q", str(upstream), str(dest), cwd=root)
    (dest / "README.md").write_text("my edit\n")
    assert _apply(upstream, series, dest) == 2
    assert "uncommitted changes" in capsys.readouterr().err
    assert (dest / "README.md").read_text() == "my edit\n"


HOLD = (
    "import fcntl, os, sys, time\n"
    "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
    "fcntl.flock(fd, fcntl.LOCK_EX)\n"
    "os.write(fd, b'%d otherhost\\n' % os.getpid())\n"
    "print('held', flush=True)\n"
    "time.sleep(60)\n"
)


def hold_lock(path):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_second_concurrent_apply_is_busy_exit_5(toy, capsys):
    root, upstream, series = toy
    dest = root / "clone"
    run("clone", "-q", str(upstream), str(dest), cwd=root)
    holder = hold_lock(dest / ".git" / LOCK_NAME)
    try:
        before = snapshot(dest)
        assert _apply(upstream, series, dest) == EXIT_BUSY
        err = one_line(capsys)
        assert f"another megatron-rocm run (pid {holder.pid})" in err
        assert snapshot(dest) == before
    finally:
        holder.kill()
        holder.wait()
    assert _apply(upstream, series, dest) == 0  # the lock died with its holder


def test_concurrent_fresh_apply_is_busy_exit_5(toy, capsys):
    """The loser of two fresh applies to one destination: exit 5, one line, no traceback."""
    root, upstream, series = toy
    dest = root / "fresh"
    holder = hold_lock(root / f".fresh.{LOCK_NAME}")
    try:
        assert _apply(upstream, series, dest) == EXIT_BUSY
        assert "is working on" in one_line(capsys)
        assert not dest.exists()
    finally:
        holder.kill()
        holder.wait()


def test_lock_path_that_is_a_folder_is_exit_3(toy, capsys):
    root, upstream, series = toy
    dest = root / "clone"
    run("clone", "-q", str(upstream), str(dest), cwd=root)
    (dest / ".git" / LOCK_NAME).mkdir()
    before = snapshot(dest)
    assert _apply(upstream, series, dest) == 3
    assert "is a folder" in one_line(capsys)
    assert snapshot(dest) == before


def test_unwritable_lock_file_is_exit_3(toy, capsys, owner_permissions):
    root, upstream, series = toy
    dest = root / "clone"
    run("clone", "-q", str(upstream), str(dest), cwd=root)
    lock = dest / ".git" / LOCK_NAME
    lock.write_text("")
    lock.chmod(0o444)
    assert _apply(upstream, series, dest) == 3
    assert "cannot take the lock" in one_line(capsys)


def test_unknown_ref_is_exit_2_on_fresh_and_existing_dest(toy, capsys):
    root, upstream, series = toy
    assert _apply(upstream, series, root / "fresh", "core_v9.9.9") == 2
    assert "unknown ref 'core_v9.9.9' in " + str(upstream) in one_line(capsys)
    assert not (root / "fresh").exists() and leftovers(root / "fresh") == []
    dest = root / "clone"
    run("clone", "-q", "--no-tags", str(upstream), str(dest), cwd=root)
    before = snapshot(dest)
    assert _apply(upstream, series, dest, "core_v9.9.9") == 2  # fetched from --source: unknown
    assert "unknown ref 'core_v9.9.9'" in one_line(capsys)
    assert main(["apply", "--series", str(series), "--dest", str(dest), "--ref", "nope"]) == 2
    assert "pass --source" in one_line(capsys)
    assert snapshot(dest) == before


def test_existing_clone_without_the_tag_fetches_it(toy, capsys):
    root, upstream, series = toy
    dest = root / "clone"
    run("clone", "-q", "--no-tags", "--single-branch", str(upstream), str(dest), cwd=root)
    assert _apply(upstream, series, dest, "core_v0.2.0") == 0
    assert run("rev-parse", "--abbrev-ref", "HEAD", cwd=dest) == "rocm/core_v0.2.0"
    assert run("status", "--porcelain", cwd=dest) == ""


@pytest.mark.parametrize("bad", [("--ref", "-D"), ("--branch", "-D"), ("--branch", "a..b")])
def test_bad_names_are_exit_2_before_any_clone(toy, capsys, bad):
    """A source that cannot be cloned proves the check came first (else exit 3)."""
    root, _, series = toy
    url = "file://" + str(root / "missing.git")
    argv = ["apply", "--source", url, "--series", str(series), "--dest", str(root / "d")]
    assert main([*argv, f"{bad[0]}={bad[1]}"]) == 2
    assert f"{bad[0]} {bad[1]!r} is not a valid" in one_line(capsys)
    assert sorted(p.name for p in root.iterdir()) == ["patches", "series-work", "upstream"]


def test_branch_that_exists_at_the_tip_is_checked_out(toy, capsys):
    """The state an interrupted older version left: branch made, HEAD elsewhere."""
    root, upstream, series = toy
    dest = root / "fork"
    assert _apply(upstream, series, dest) == 0
    run("checkout", "-q", "main", cwd=dest)
    capsys.readouterr()
    assert _apply(upstream, series, dest) == 0
    assert "checked out rocm/core_v0.2.0" in capsys.readouterr().out
    assert run("rev-parse", "--abbrev-ref", "HEAD", cwd=dest) == "rocm/core_v0.2.0"
    assert run("status", "--porcelain", cwd=dest) == ""


def test_copied_fork_with_stale_index_stat_data_switches(toy):
    """A fork copied (or restored from a backup) has stale stat data in its index; the
    switch refreshes it as git checkout does instead of calling every file modified."""
    root, upstream, series = toy
    first = root / "first"
    run("clone", "-q", str(upstream), str(first), cwd=root)
    copy = root / "copy"
    shutil.copytree(first, copy, symlinks=True)
    assert _apply(upstream, series, copy) == 0
    assert run("status", "--porcelain", cwd=copy) == ""


def test_commits_name_their_patch_and_upstream_base(toy):
    root, upstream, series = toy
    dest = root / "fork"
    assert _apply(upstream, series, dest) == 0
    base = run("rev-parse", "core_v0.2.0^{commit}", cwd=dest)
    body = run("log", "-1", "--format=%B", cwd=dest)
    assert body.splitlines()[-2:] == ["Megatron-ROCm-Patch: p-norm", f"Megatron-ROCm-Base: {base}"]


def test_existing_branch_with_user_commits_is_not_overwritten(toy, capsys):
    root, upstream, series = toy
    dest = root / "fork"
    assert _apply(upstream, series, dest) == 0
    (dest / "README.md").write_text("user work\n")
    run("commit", "-qam", "my work", cwd=dest)
    tip = run("rev-parse", "HEAD", cwd=dest)
    assert _apply(upstream, series, dest) == 2
    assert "already exists" in capsys.readouterr().err
    assert run("rev-parse", "rocm/core_v0.2.0", cwd=dest) == tip


def test_three_way_flag_applies_what_needs_a_merge(toy, capsys):
    root, upstream, series = toy
    dest = root / "fork"
    assert _apply(upstream, series, dest, "core_v0.6.0") == 1
    assert "retry with --3way" in capsys.readouterr().err
    assert _apply(upstream, series, dest, "core_v0.6.0", "--3way", "--json") == 0
    out = json.loads(capsys.readouterr().out)
    assert out["branch"] == "rocm/core_v0.6.0"
    text = (dest / "megatron/core/norm.py").read_text()
    assert "norm_12 = 'upstream'" in text and "norm_14 = 'fourteen'" in text


def test_already_upstream_patch_makes_no_commit(toy, capsys):
    root, upstream, series = toy
    dest = root / "fork"
    assert _apply(upstream, series, dest, "core_v0.5.0", "--json") == 0
    out = json.loads(capsys.readouterr().out)
    commits = {c["patch"]: c["commit"] for c in out["commits"]}
    assert commits["p-softmax"] is None and commits["p-norm"]


def test_rebase_in_progress_is_refused_and_nothing_changes(toy, capsys):
    """A switch in the middle of ``rebase -i`` let the rebase finish onto the wrong branch:
    the user's commit left their branch. Refused, as export refuses it."""
    root, upstream, series = toy
    dest = root / "fork"
    assert _apply(upstream, series, dest) == 0
    (dest / "README.md").write_text("user work\n")
    run("commit", "-qam", "my work", cwd=dest)
    subprocess.run(
        ["git", "rebase", "-i", "HEAD~1"],
        cwd=dest,
        env={**os.environ, "GIT_SEQUENCE_EDITOR": "sed -i 's/^pick/edit/'"},
        capture_output=True,
        check=True,
    )
    assert (dest / ".git" / "rebase-merge").is_dir()
    capsys.readouterr()
    before = snapshot(dest)
    assert _apply(upstream, series, dest, "core_v0.5.0") == 2
    assert "a rebase is in progress" in one_line(capsys)
    assert snapshot(dest) == before
    run("rebase", "--continue", cwd=dest)
    assert run("log", "-1", "--format=%s", "rocm/core_v0.2.0", cwd=dest) == "my work"


def test_index_held_by_another_git_is_busy_and_nothing_changes(toy, capsys):
    """``git commit`` waiting in its editor holds ``.git/index.lock`` and renames it over the
    index when done: a switch under it would end with the old branch's index."""
    root, upstream, series = toy
    dest = root / "fork"
    assert _apply(upstream, series, dest) == 0
    (dest / ".git" / "index.lock").write_bytes(b"")
    capsys.readouterr()
    before = snapshot(dest)
    assert _apply(upstream, series, dest, "core_v0.5.0") == EXIT_BUSY
    assert "index.lock" in one_line(capsys)
    assert snapshot(dest) == before
    (dest / ".git" / "index.lock").unlink()
    assert _apply(upstream, series, dest, "core_v0.5.0") == 0
    assert run("status", "--porcelain", cwd=dest) == ""


def test_branch_checked_out_in_another_worktree_is_refused(toy, capsys):
    """git refuses to check one branch out twice: the second worktree would show the first
    one's commits as staged reverts."""
    root, upstream, series = toy
    dest = root / "fork"
    assert _apply(upstream, series, dest) == 0  # rocm/core_v0.2.0, checked out here
    other = root / "other"
    run("worktree", "add", "-q", "--detach", str(other), "main", cwd=dest)
    capsys.readouterr()
    before = snapshot(other)
    assert _apply(upstream, series, other) == 2
    err = one_line(capsys)
    assert "rocm/core_v0.2.0 is checked out in" in err and str(dest.name) in err
    assert snapshot(other) == before


def _switch_fails_after_writing(monkeypatch):
    """The switch's ``read-tree -m -u`` writes every file, then fails (as one it cannot write
    half way would: a read-only folder, a full disk)."""
    from megatron_rocm.patchtool import gitcmd

    real = gitcmd.git

    def failing(*args, **kw):
        out = real(*args, **kw)
        if args[:3] == ("read-tree", "-m", "-u") and "-n" not in args:
            raise gitcmd.GitError(
                "git read-tree -m -u failed: error: unable to create file: Permission denied",
                reason="unable to create file: Permission denied",
            )
        return out

    monkeypatch.setattr(gitcmd, "git", failing)


def test_a_switch_that_fails_half_way_is_undone(toy, capsys, monkeypatch):
    """A failed apply leaves the fork exactly as it was: files written by the failed switch
    go back, files it added go, the branch it made goes, and the next run just works."""
    root, upstream, series = toy
    dest = root / "fork"
    assert _apply(upstream, series, dest) == 0
    run("rm", "-q", "README.md", cwd=dest)  # so that the switch adds a file, then must drop it
    run("commit", "-qm", "no readme", cwd=dest)
    capsys.readouterr()
    before = snapshot(dest)
    with monkeypatch.context() as patched:
        _switch_fails_after_writing(patched)
        assert _apply(upstream, series, dest, "core_v0.5.0") == 3
    err = one_line(capsys)
    assert "Permission denied" in err and "nothing was changed" in err
    assert snapshot(dest) == before
    assert leftovers(dest) == []
    assert _apply(upstream, series, dest, "core_v0.5.0") == 0
    assert run("rev-parse", "--abbrev-ref", "HEAD", cwd=dest) == "rocm/core_v0.5.0"
    assert run("status", "--porcelain", cwd=dest) == ""
