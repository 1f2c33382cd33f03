"""One writer at a time per destination: an ``flock``-ed file that names its holder.

Why ``flock`` and not "create if absent": the kernel drops the lock when its process dies,
even by SIGKILL, so a crashed run never blocks the next one, and there is no race between
two runs clearing a stale file. The file holds ``<pid> <host>`` only to name the holder in the
busy message (exit 5) and to report that a previous holder died without cleaning up.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from megatron_rocm.errors import Busy, SourceError

LOCK_NAME = "megatron-rocm.lock"


@dataclass
class Held:
    path: Path
    previous: str  # "<pid> <host>" left by a holder that died without unlocking, else ""
    fd: int = -1  # the locked descriptor (children that must keep the lock inherit it)


def _open(path: Path) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except IsADirectoryError:
        raise SourceError(f"cannot take the lock {path}: it is a folder; remove it") from None
    except OSError as e:
        raise SourceError(f"cannot take the lock {path}: {e.strerror}") from None


def _holder(fd: int) -> str:
    with contextlib.suppress(OSError):
        return os.pread(fd, 200, 0).decode(errors="replace").strip()
    return ""


def _busy(e: OSError) -> bool:
    return e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)


def _take(fd: int, path: Path, what: str, wait: bool) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return
    except OSError as e:
        holder = _holder(fd)
        pid = holder.split()[0] if holder else "?"
        if not _busy(e):
            os.close(fd)
            raise SourceError(f"cannot lock {path}: {e.strerror}") from None
        if not wait:
            os.close(fd)
            raise Busy(
                f"another megatron-rocm run (pid {pid}) is working on {what}; "
                "wait for it to finish, then run this again"
            ) from None
    print(f"note: waiting for another megatron-rocm run (pid {pid}) on {what}", file=sys.stderr)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except BaseException:
        os.close(fd)
        raise


@contextlib.contextmanager
def hold(path: Path, what: str, wait: bool = False) -> Iterator[Held]:
    """Hold the lock at ``path`` for ``what`` (named in the busy message).

    Without ``wait``, a lock held by a live process raises ``Busy`` at once (exit 5); with it
    (shared caches), say so once and wait.
    """
    while True:
        fd = _open(path)
        _take(fd, path, what, wait)
        # The file may have been unlinked by the previous holder between our open and flock:
        # then this lock protects nothing; take the one now at the path.
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    previous = _holder(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
    except OSError as e:
        os.close(fd)
        raise SourceError(f"cannot write the lock {path}: {e.strerror}") from None
    try:
        yield Held(path, previous, fd)
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
        os.close(fd)


def clear_stale(path: Path) -> str | None:
    """Remove a lock file no live process holds (its holder was killed); return the
    ``<pid> <host>`` it named, or None when there was nothing to clear."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return None  # a live run holds it
        holder = _holder(fd)
        with contextlib.suppress(OSError):
            path.unlink()
        return holder or "?"
    finally:
        os.close(fd)
