"""Scratch folders named after their owner, so that what a killed run leaves is found later.

Why: SIGKILL (or a power cut) skips every ``finally``. A fresh apply clones into a hidden
sibling of the destination (tens of MB) and tree writes use a folder inside ``.git``; if their
names carry the host and pid of the process that made them, the next run on that destination
can tell leftovers of a dead process from the work of a live one, remove them and say so.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from megatron_rocm.patchtool import interrupts

GIT_PREFIX = "megatron-rocm-"  # inside a git dir: private indexes of tree writes


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9]+", "", socket.gethostname())[:24] or "host"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def make(parent: Path, prefix: str) -> Path:
    """A new empty folder ``<prefix><host>-<pid>-<random>`` in ``parent``."""
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{_host()}-{os.getpid()}-", dir=parent))


@contextlib.contextmanager
def _stops_held() -> Iterator[None]:
    """Hold Ctrl-C, SIGTERM and SIGHUP back (they arrive when this ends) while a scratch
    folder is made or removed: one landing half way would leave it behind after the run
    reported that nothing was left.

    Why Python-level handlers and not ``pthread_sigmask``: a mask covers only the calling
    thread, and in a process with any other thread (GitPython's output readers, a progress
    bar) the kernel hands the signal to that thread, whose C handler still makes the main
    thread raise at once. A handler that only records the signal works whichever thread the
    kernel picks. Main thread only (``signal.signal`` demands it); elsewhere a no-op. A
    handler set outside Python cannot be put back, and an ignored signal needs no holding:
    those are left alone."""
    pending: list[int] = []

    def defer(signum: int, _frame: object) -> None:
        pending.append(signum)

    try:
        with interrupts.handling(
            interrupts.SIGNALS, defer, lambda current: current not in (None, signal.SIG_IGN)
        ):
            yield
    finally:
        for stop in dict.fromkeys(pending):
            signal.raise_signal(stop)  # now handled as it would have been


@contextlib.contextmanager
def folder(parent: Path, prefix: str) -> Iterator[Path]:
    """``make`` and remove it afterwards, whatever happens (short of SIGKILL); an interrupt
    cannot land between making it and owning its removal, nor half way through removing."""
    path: Path | None = None
    try:  # a stop held back while making it arrives here, where the removal is owed
        with _stops_held():
            path = make(parent, prefix)
        yield path
    finally:
        if path is not None:
            with _stops_held():
                shutil.rmtree(path, ignore_errors=True)


@dataclass(frozen=True)
class Leftover:
    path: Path
    pid: int
    size: int  # bytes

    def describe(self) -> str:
        mb = self.size / 1e6
        amount = f"{mb:.0f} MB" if mb >= 1 else f"{self.size} bytes"
        return f"{self.path} ({amount}, from pid {self.pid})"


def _size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def sweep(parent: Path, prefix: str) -> list[Leftover]:
    """Remove this host's ``<prefix>*`` folders in ``parent`` whose process is gone."""
    pattern = re.compile(re.escape(prefix) + re.escape(_host()) + r"-(\d+)-")
    removed: list[Leftover] = []
    try:
        entries = list(parent.iterdir())
    except OSError:
        return removed
    for entry in sorted(entries):
        m = pattern.match(entry.name)
        if not m or int(m.group(1)) == os.getpid() or pid_alive(int(m.group(1))):
            continue
        size = _size(entry)
        shutil.rmtree(entry, ignore_errors=True)
        if not entry.exists():
            removed.append(Leftover(entry, int(m.group(1)), size))
    return removed
