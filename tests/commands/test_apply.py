"""apply: fork branch, idempotence, atomic failure, kill mid-apply, dirty trees, locking."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from toyrepo import apply_argv, run, snapshot

from megatron_rocm.main import main
from megatron_rocm.patchtool.lock import LOCK_NAME


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
    assert not dest.exists()
    assert [p.name for p in root.iterdir() if p.name.startswith(".new")] == []


def test_report_is_printed_once_the_fork_is_in_place(toy, monkeypatch):
    """`apply --json | head` closes the pipe mid-report: the finished fork must stay."""
    root, upstream, series = toy
    dest = root / "piped"
    seen = []

    def closed_pipe(payload):
        seen.append(dest.is_dir() and payload["ok"])
        raise BrokenPipeError

    monkeypatch.setattr("megatron_rocm.commands.apply.print_json", closed_pipe)
    assert _apply(upstream, series, dest, "core_v0.2.0", "--json") == 1
    assert seen == [True]
    assert run("rev-parse", "--abbrev-ref", "HEAD", cwd=dest).startswith("rocm/")


def test_kill_in_the_middle_of_apply_leaves_tree_identical(toy):
    root, upstream, series = toy
    dest = root / "clone"
    run("clone", "-q", str(upstream), str(dest), cwd=root)
    before = snapshot(dest)
    env = {**os.environ, "MEGATRON_ROCM_TEST_KILL_AFTER": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rocm", *apply_argv(upstream, series, dest)],
        env=env,
        capture_output=True,
    )
    assert proc.returncode == -9
    assert (dest / ".git" / LOCK_NAME).exists()  # a stale lock of a dead process...
    assert snapshot(dest) == before
    assert _apply(upstream, series, dest) == 0  # ...is cleared by the next run


def test_dirty_tree_is_refused_and_edits_kept(toy, capsys):
    root, upstream, series = toy
    dest = root / "clone"
    run("clone", "-q", str(upstream), str(dest), cwd=root)
    (dest / "README.md").write_text("my edit\n")
    assert _apply(upstream, series, dest) == 2
    assert "uncommitted changes" in capsys.readouterr().err
    assert (dest / "README.md").read_text() == "my edit\n"


def test_second_concurrent_apply_is_refused(toy, capsys):
    root, upstream, series = toy
    dest = root / "clone"
    run("clone", "-q", str(upstream), str(dest), cwd=root)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        (dest / ".git" / LOCK_NAME).write_text(str(holder.pid))
        before = snapshot(dest)
        assert _apply(upstream, series, dest) == 1
        assert f"another megatron-rocm apply (pid {holder.pid})" in capsys.readouterr().err
        assert snapshot(dest) == before
    finally:
        holder.kill()
        holder.wait()


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
