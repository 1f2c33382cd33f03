"""SIGKILL at every step of an ``export``'s write into the series folder.

The export changes both toy patches (a new variant each: a new diff and a ``patch.toml``
change) and adds a patch (a new folder and a ``series`` line), so its write replaces or adds
seven files, one rename each. A real ``export`` process is killed once the files are staged
(before the commit point) and at each rename in turn (after it); the next command that loads
the series (``list``) must leave the series folder exactly as it was before the export or
exactly as an uninterrupted export leaves it (every path, every file's bytes), with nothing
beside it: no staged or kept copy, no journal, no lock. A run killed while it finishes that
write is finished by the one after it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from toyrepo import NORM, SOFTMAX, apply_argv, make_series, make_upstream, run, seal

from megatron_rocm.main import main
from megatron_rocm.patchtool.interrupts import FAULT_ENV

pytestmark = pytest.mark.full  # a dozen killed export processes

NEW_PATCH = "document-rocm-usage"


@dataclass
class World:
    fork: Path
    template: Path  # the series before the export
    before: dict[str, bytes | None]
    after: dict[str, bytes | None]  # after an uninterrupted export
    renames: int


def _tree(series: Path) -> dict[str, bytes | None]:
    """Every path under the series folder (None: a folder) with its bytes, and whatever lies
    beside the folder (a journal, a lock) under a ``../`` name."""
    out: dict[str, bytes | None] = {
        str(p.relative_to(series)): None if p.is_dir() else p.read_bytes()
        for p in sorted(series.rglob("*"))
    }
    out |= {f"../{p.name}": b"" for p in series.parent.iterdir() if p != series}
    return out


def _edit_both_patches_and_add_one(fork: Path) -> None:
    """Amend each patch commit (as a rebase would) and put a new commit on top."""
    branch = run("symbolic-ref", "--short", "HEAD", cwd=fork)
    commits = run("rev-list", "--reverse", "core_v0.2.0..HEAD", cwd=fork).splitlines()
    run("checkout", "-q", "--detach", "core_v0.2.0", cwd=fork)
    for commit, rel in zip(commits, (SOFTMAX, NORM), strict=True):
        run("cherry-pick", commit, cwd=fork)
        with open(fork / rel, "a") as f:
            f.write("rocm_tuned = True\n")
        run("commit", "-q", "-a", "--amend", "--no-edit", cwd=fork)
    (fork / "README.md").write_text("rocm readme\n")
    run("commit", "-qam", "Document ROCm usage", cwd=fork)
    run("checkout", "-q", "-B", branch, cwd=fork)


def _export(fork: Path, series: Path, fault: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
    if fault:
        env[FAULT_ENV] = fault
    argv = ["export", "--repo", str(fork), "--series", str(series), "--new-variant"]
    return subprocess.run(
        [sys.executable, "-m", "megatron_rocm", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    root = tmp_path_factory.mktemp("export-faults")
    with pytest.MonkeyPatch.context() as mp:
        seal(mp, root / "home")
        upstream = make_upstream(root)
        made = make_series(root, upstream)
        template = root / "before" / "patches"  # alone in its folder, as _tree wants
        shutil.copytree(made, template)
        fork = root / "fork"
        assert main(apply_argv(upstream, made, fork)) == 0
        _edit_both_patches_and_add_one(fork)
        done = root / "done" / "patches"
        shutil.copytree(template, done)
        result = _export(fork, done)
        assert result.returncode == 0, result.stderr
        before, after = _tree(template), _tree(done)
        changed = [k for k, v in after.items() if v is not None and before.get(k) != v]
        assert len(changed) == 7, changed  # 2 x (new diff, patch.toml), 2 new files, series
        assert f"{NEW_PATCH}/patch.toml" in changed and "series" in changed
        return World(fork, template, before, after, len(changed))


def _series_copy(world: World, tmp_path: Path) -> Path:
    series = tmp_path / "s" / "patches"
    shutil.copytree(world.template, series)
    return series


def _list(series: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megatron_rocm", "list", "--series", str(series)],
        env={k: v for k, v in os.environ.items() if k != FAULT_ENV},
        capture_output=True,
        text=True,
        timeout=120,
    )


def _killed_at(world: World, series: Path, step: str) -> None:
    result = _export(world.fork, series, f"{step}:SIGKILL")
    assert result.returncode == -9, (step, result.returncode, result.stderr)


@pytest.mark.parametrize("at", ["export-staged", "export-rename-{}"])
def test_a_killed_export_leaves_the_series_before_or_after_never_between(world, tmp_path, at):
    steps = [at] if "{}" not in at else [at.format(n) for n in range(1, world.renames + 1)]
    for step in steps:
        series = _series_copy(world, tmp_path / step)
        _killed_at(world, series, step)
        listed = _list(series)
        assert listed.returncode == 0, (step, listed.stderr)
        want = world.before if step == "export-staged" else world.after
        assert _tree(series) == want, step
        assert (NEW_PATCH in listed.stdout) == (want is world.after), step
        assert "interrupted export" in listed.stderr, step  # said once what it did
        assert "Traceback" not in listed.stderr


def test_a_run_killed_while_finishing_the_write_is_finished_by_the_next(world, tmp_path):
    series = _series_copy(world, tmp_path)
    _killed_at(world, series, "export-rename-3")
    env = {**os.environ, FAULT_ENV: "recover-rename-5:SIGKILL"}
    killed = subprocess.run(
        [sys.executable, "-m", "megatron_rocm", "list", "--series", str(series)],
        env=env,
        capture_output=True,
        timeout=120,
    )
    assert killed.returncode == -9, killed.stderr
    again = _export(world.fork, series)  # a second export settles it too, then changes nothing
    assert again.returncode == 0, again.stderr
    assert "0 changed" in again.stdout
    assert _tree(series) == world.after
