"""Fault injection at every step boundary of the apply transaction, fresh and existing dest.

For each step named in ``transaction.FRESH_STEPS`` / ``EXISTING_STEPS`` (``MEGATRON_ROCM_FAULT``):

- SIGINT / SIGTERM: before the commit point the destination is exactly as it was (HEAD, refs,
  index, status, file hashes) and nothing is left behind; after it the apply completes. The
  exit code is 128 + the signal, with one line saying which of the two happened.
- SIGKILL: nothing visible changes before the commit point; the next run on that destination
  removes or finishes what the killed one left, says so, and ends exactly like an
  uninterrupted apply.

The comparisons are against an uninterrupted apply of the same toy series (commits are
deterministic, so the states match exactly).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from toyrepo import apply_argv, leftovers, make_series, make_upstream, run, seal, snapshot

from megatron_rocm.main import main
from megatron_rocm.patchtool.interrupts import FAULT_ENV, READY_ENV
from megatron_rocm.patchtool.transaction import EXISTING_STEPS, FRESH_STEPS

pytestmark = pytest.mark.full

FRESH_COMMIT = FRESH_STEPS.index("committed")
EXISTING_COMMIT = EXISTING_STEPS.index("journal-written")
REF = "core_v0.2.0"


@dataclass
class World:
    upstream: Path
    series: Path
    template: Path  # an existing clone: main checked out, the tag not fetched, a user file
    fresh_done: tuple  # snapshot of an uninterrupted fresh apply
    existing_done: tuple  # snapshot of an uninterrupted apply into a copy of the template


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    root = tmp_path_factory.mktemp("faults")
    with pytest.MonkeyPatch.context() as mp:
        seal(mp, root / "home")
        upstream = make_upstream(root)
        series = make_series(root, upstream)
        template = root / "template"
        run("clone", "-q", "--no-tags", "--single-branch", str(upstream), str(template), cwd=root)
        (template / "notes.txt").write_text("untracked user notes\n")
        assert main(apply_argv(upstream, series, root / "fresh-ref", REF)) == 0
        existing = root / "existing-ref"
        shutil.copytree(template, existing, symlinks=True)
        assert main(apply_argv(upstream, series, existing, REF)) == 0
        return World(upstream, series, template, snapshot(root / "fresh-ref"), snapshot(existing))


def _argv(world: World, dest: Path) -> list[str]:
    return apply_argv(world.upstream, world.series, dest, REF)


def _existing(world: World, tmp_path: Path) -> Path:
    dest = tmp_path / "fork"
    shutil.copytree(world.template, dest, symlinks=True)
    return dest


def _one_line(err: str) -> str:
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("step", FRESH_STEPS)
def test_fresh_apply_signalled_at_each_step(world, tmp_path, monkeypatch, capsys, step, sig):
    dest = tmp_path / "fork"
    monkeypatch.setenv(FAULT_ENV, f"{step}:{sig}")
    assert main(_argv(world, dest)) == 128 + signal.Signals[sig]
    err = _one_line(capsys.readouterr().err)
    if FRESH_STEPS.index(step) < FRESH_COMMIT:
        assert "nothing was changed" in err
        assert not dest.exists()
    else:
        assert "the apply finished" in err
        assert snapshot(dest) == world.fresh_done
    assert leftovers(dest) == []


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("step", EXISTING_STEPS)
def test_existing_fork_signalled_at_each_step(world, tmp_path, monkeypatch, capsys, step, sig):
    dest = _existing(world, tmp_path)
    before = snapshot(dest)
    monkeypatch.setenv(FAULT_ENV, f"{step}:{sig}")
    assert main(_argv(world, dest)) == 128 + signal.Signals[sig]
    err = _one_line(capsys.readouterr().err)
    if EXISTING_STEPS.index(step) < EXISTING_COMMIT:
        assert "nothing was changed" in err
        assert snapshot(dest) == before
    else:
        assert "the apply finished" in err
        assert snapshot(dest) == world.existing_done
    assert leftovers(dest) == []


def _killed(world: World, dest: Path, step: str) -> None:
    env = {**os.environ, FAULT_ENV: f"{step}:SIGKILL"}
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rocm", *_argv(world, dest)], env=env, capture_output=True
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr


@pytest.mark.parametrize("step", FRESH_STEPS)
def test_fresh_apply_killed_at_each_step_then_next_run_cleans_up(world, tmp_path, capsys, step):
    dest = tmp_path / "fork"
    _killed(world, dest, step)
    if FRESH_STEPS.index(step) < FRESH_COMMIT:
        assert not dest.exists()
    else:
        assert snapshot(dest) == world.fresh_done  # renamed into place: complete
    # the lock (and maybe a half-made clone) of the dead process; "finished" is past the lock
    assert bool(leftovers(dest)) == (step != "finished")
    assert main(_argv(world, dest)) == 0
    err = capsys.readouterr().err
    assert ("killed" in err) == (step != "finished") and "Traceback" not in err
    assert snapshot(dest) == world.fresh_done
    assert leftovers(dest) == []


@pytest.mark.parametrize("step", EXISTING_STEPS)
def test_existing_fork_killed_at_each_step_then_next_run_finishes(world, tmp_path, capsys, step):
    dest = _existing(world, tmp_path)
    before = snapshot(dest)
    _killed(world, dest, step)
    if EXISTING_STEPS.index(step) < EXISTING_COMMIT:
        assert snapshot(dest) == before
    assert bool(leftovers(dest)) == (step != "finished")
    assert main(_argv(world, dest)) == 0
    err = capsys.readouterr().err
    assert ("killed" in err) == (step != "finished") and "Traceback" not in err
    if EXISTING_STEPS.index(step) >= EXISTING_COMMIT and step != "finished":
        assert "finishing an apply of rocm/core_v0.2.0" in err
    assert snapshot(dest) == world.existing_done
    assert leftovers(dest) == []


def test_recovery_never_overwrites_an_edit_made_after_the_kill(world, tmp_path, capsys):
    dest = _existing(world, tmp_path)
    _killed(world, dest, "tree-updated")  # work tree switched, index and HEAD not yet
    softmax = dest / "megatron/core/fusions/softmax.py"
    softmax.write_text("my edit after the crash\n")
    assert main(_argv(world, dest)) == 2
    err = capsys.readouterr().err
    assert "megatron/core/fusions/softmax.py differs from both versions" in err
    assert softmax.read_text() == "my edit after the crash\n"
    readme = dest / "README.md"
    run("checkout", "--", "megatron/core/fusions/softmax.py", cwd=dest)
    readme.write_text("edited elsewhere\n")
    assert main(_argv(world, dest)) == 2
    assert "README.md was edited after an interrupted apply" in capsys.readouterr().err
    run("checkout", "--", "README.md", cwd=dest)
    assert main(_argv(world, dest)) == 0  # nothing of the user's left in the way: finished
    assert snapshot(dest) == world.existing_done


def test_sighup_is_an_interrupt_too(world, tmp_path, monkeypatch, capsys):
    dest = _existing(world, tmp_path)
    before = snapshot(dest)
    monkeypatch.setenv(FAULT_ENV, "planned:SIGHUP")
    assert main(_argv(world, dest)) == 128 + signal.SIGHUP
    assert snapshot(dest) == before


@pytest.mark.parametrize(("step", "finished"), [("planned", False), ("journal-written", True)])
def test_terminal_ctrl_c_to_the_process_group(world, tmp_path, step, finished):
    """A real Ctrl-C reaches every process of the foreground group, git included: before the
    commit point all of it stops cleanly, after it the apply (and its git) still completes."""
    dest = _existing(world, tmp_path)
    before = snapshot(dest)
    ready = tmp_path / "ready"
    env = {**os.environ, FAULT_ENV: f"{step}:pause", READY_ENV: str(ready)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "megatron_rocm", *_argv(world, dest)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while not ready.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert ("the apply finished" if finished else "nothing was changed") in _one_line(err)
    assert snapshot(dest) == (world.existing_done if finished else before)
    assert leftovers(dest) == []
