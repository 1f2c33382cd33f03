"""The destination lock: busy (exit 5) while held, free once its holder dies, clear errors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megatron_rocm.errors import EXIT_BUSY, Busy, SourceError
from megatron_rocm.patchtool import lock, scratch

HOLD = (
    "import fcntl, os, sys, time\n"
    "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
    "fcntl.flock(fd, fcntl.LOCK_EX)\n"
    "os.write(fd, b'%d h\\n' % os.getpid())\n"
    "print('held', flush=True)\n"
    "time.sleep(60)\n"
)


def test_held_lock_is_busy_then_free_when_holder_dies(tmp_path):
    path = tmp_path / "x.lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE)
    assert holder.stdout.readline().strip() == b"held"
    try:
        with pytest.raises(Busy) as e, lock.hold(path, "the fork"):
            pass
        assert e.value.code == EXIT_BUSY and f"pid {holder.pid}" in str(e.value)
    finally:
        holder.kill()
        holder.wait()
    with lock.hold(path, "the fork") as held:  # SIGKILL released it; the file names the dead
        assert held.previous.startswith(str(holder.pid))
        assert path.read_text().startswith(str(os.getpid()))
    assert not path.exists()


def test_clean_release_leaves_no_previous_holder(tmp_path):
    path = tmp_path / "x.lock"
    with lock.hold(path, "a"):
        pass
    with lock.hold(path, "a") as held:
        assert held.previous == ""


def test_lock_path_problems_are_environment_errors(tmp_path):
    (tmp_path / "dir.lock").mkdir()
    with pytest.raises(SourceError, match="is a folder"), lock.hold(tmp_path / "dir.lock", "a"):
        pass
    with pytest.raises(SourceError, match="cannot take the lock"):
        with lock.hold(tmp_path / "missing" / "x.lock", "a"):
            pass


def test_clear_stale_only_removes_unheld_locks(tmp_path):
    path = tmp_path / "x.lock"
    path.write_text("12345 host\n")
    assert lock.clear_stale(path) == "12345 host"
    assert not path.exists()
    with lock.hold(path, "a"):
        assert lock.clear_stale(path) is None
        assert path.exists()


def test_scratch_sweep_removes_only_dead_owners(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    mine = scratch.make(tmp_path, ".d.apply-")
    theirs = tmp_path / mine.name.replace(f"-{os.getpid()}-", f"-{dead.pid}-")
    theirs.mkdir()
    (theirs / "blob").write_bytes(b"x" * 2000)
    other = tmp_path / ".d.apply-nothost-1-abc"
    other.mkdir()
    removed = scratch.sweep(tmp_path, ".d.apply-")
    assert [r.path for r in removed] == [theirs]
    assert removed[0].size == 2000 and removed[0].pid == dead.pid
    assert mine.exists() and other.exists() and not theirs.exists()


@pytest.mark.parametrize("another_thread", [False, True], ids=["alone", "with-a-thread"])
@pytest.mark.parametrize("when", ["made", "removing"])
def test_a_ctrl_c_while_a_scratch_folder_is_made_or_removed_leaves_none(
    tmp_path, monkeypatch, when, another_thread
):
    """The signal is held back until the folder's removal is owed (made) or done (removing),
    then arrives as usual: a run that says nothing was left leaves nothing. With another
    thread alive (GitPython's readers are one) the kernel may hand the signal to it, which a
    per-thread signal mask does not stop."""
    import shutil
    import signal
    import threading

    release = threading.Event()
    if another_thread:
        threading.Thread(target=release.wait, daemon=True).start()

    def ctrl_c() -> None:
        os.kill(os.getpid(), signal.SIGINT)

    # Python's own handler, whatever this process inherited (a shell's background job starts
    # with SIGINT ignored, and Python then keeps it so)
    saved = signal.signal(signal.SIGINT, signal.default_int_handler)

    if when == "made":
        real_make = scratch.make
        monkeypatch.setattr(scratch, "make", lambda *a: (real_make(*a), ctrl_c())[0])
    else:
        real_rmtree = shutil.rmtree

        def rmtree(path, **kw):
            ctrl_c()  # lands before the removal has started
            return real_rmtree(path, **kw)

        monkeypatch.setattr(scratch.shutil, "rmtree", rmtree)
    try:
        with pytest.raises(KeyboardInterrupt):
            with scratch.folder(tmp_path, "megatron-rocm-"):
                pass
    finally:
        signal.signal(signal.SIGINT, saved)
        release.set()
    assert list(tmp_path.iterdir()) == []
